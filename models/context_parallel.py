"""Context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023) inside a pipeline stage: the C ranks of a context-
parallel group hold the same rows, each its S/C consecutive positions, from the embedding to the loss.

Everything but attention works position by position, so it runs on the shard as it is: the embedding, every RMSNorm,
the MLPs, the residual stream, the stage-to-stage tensor ([B, S/C, H]; / T more under sequence parallelism) and the
loss on the shard's targets. Attention needs every position: DeepSpeed's `UlyssesSPAttentionHF` swaps the shard of
all heads for all positions of H/C heads by all-to-all, runs the family's own attention kernel on them, and swaps
back. `position_ids` stay whole ([B, S]) through the stages, so every layer builds the whole row's mask (packed
documents, sliding windows) as without CP, and RoPE turns this rank's slice of them into angles.

Rank r of the group holds positions [r * S/C, (r + 1) * S/C); with sequence parallelism its TP ranks split those
again (models/sequence_parallel.py), so the row is cut into C x T equal pieces in rank order.
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from models.layer_config import layer_attr

ATTENTION_KEY = "context_parallel"  # the transformers attention-interface key of a CP layer's attention


@dataclass
class ContextParallel:
    """This rank's place in its context-parallel group. `group` is set once the process group exists."""

    size: int = 1
    rank: int = 0
    group: Any = None
    # One Ulysses exchange per attention shape and kernel, shared by this rank's layers (gpt-oss's sink kernels are
    # per layer: one each). Its mutable state (the call's shapes) is set from the query at the start of each call
    # and not read after it, so layers may share it as long as none calls it while another's call runs; DeepSpeed's
    # constructor reads the transformers version from package metadata (10 ms each on 2 cores).
    exchanges: dict = field(default_factory=dict, repr=False, compare=False)


def shard(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """Positions [rank * S/size, (rank + 1) * S/size) of `x` along `dim` (the sequence of [B, S, ...]), in a tensor of
    their own: a view would keep the whole row's storage alive wherever autograd saves it (the embedding's ids)."""
    if size == 1:
        return x
    return x.narrow(dim, rank * (x.shape[dim] // size), x.shape[dim] // size).clone()


class _SumOverContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.size = cp.size
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=cp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.size, None


def sum_over_context(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Per-row sums of this rank's positions (a sequence's log-probability) summed over the CP group: the whole rows'.

    Every rank of the group then computes the same loss from them, and DeepSpeed averages the C ranks' gradients as
    if each were a data replica with that loss; but each backpropagates into its own positions only (the group's
    parts add up to one loss's gradient). Backward therefore multiplies by C, so the average is that sum."""
    if cp.size == 1:
        return x
    if not x.requires_grad:
        x = x.contiguous().clone()
        torch.distributed.all_reduce(x, group=cp.group)
        return x
    return _SumOverContext.apply(x, cp)


def _ulysses_attention(module, query, key, value, attention_mask, **kwargs):
    """The attention-interface function every CP layer's attention calls (its config names ATTENTION_KEY): the
    layer's own `UlyssesAttention` (query, key and value: [B, heads, S/C, D], this rank's positions). Ulysses needs
    this rank's position ids, which Llama 4's decoder layer keeps from its attention: the layer leaves them on the
    module (`shard_positions`)."""
    if "position_ids" not in kwargs:
        kwargs["position_ids"] = module.shard_positions
    return module.ulysses(module, query, key, value, attention_mask, **kwargs)


class ShardOffset:
    """Stands for a KV cache holding the `offset` positions of the row before this rank's shard: Llama 4's attention
    temperature tuning counts a token's position from `past_key_values.get_seq_length()`, as in generation after
    a prompt, so a CP rank's positions count from the row's start. Holds nothing: `update` gives keys and values
    back as they are."""

    def __init__(self, offset: int):
        self.offset = offset

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return key_states, value_states


def register_attention() -> None:
    """Make ATTENTION_KEY a transformers attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_KEY, _ulysses_attention)


@functools.cache
def ulysses_class():
    """DeepSpeed's `UlyssesSPAttentionHF` taking any batch size: its shape checks are fixed at construction (the
    micro-batch size), while evaluation may use another one and DPO runs pairs (imported late: DeepSpeed)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    class UlyssesAttention(UlyssesSPAttentionHF):
        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            if query.shape[0] != self.batch_size:
                self.batch_size = query.shape[0]
                self.required_query_shape = torch.Size([1, self.batch_size, *self.required_query_shape[2:]])
                self.required_key_value_shape = torch.Size([1, self.batch_size, *self.required_key_value_shape[2:]])
                self.required_context_shape = torch.Size([1, self.batch_size, self.required_context_shape[2]])
            pad = key.shape[-1] - value.shape[-1]  # MLA's value heads are narrower than its query and key heads
            if pad:  # DeepSpeed's exchange takes one head size: zero columns travel and are dropped after
                value = torch.nn.functional.pad(value, (0, pad))
            out, weights = super().forward(module, query, key, value, attention_mask, *args, **kwargs)
            if pad:  # [B, S/C, heads * D] -> each head's first D - pad columns
                out = out.view(*out.shape[:2], -1, key.shape[-1])[..., :-pad].reshape(*out.shape[:2], -1)
            return out, weights

    return UlyssesAttention


def tile_mlp(mlp: torch.nn.Module, tiles: int) -> None:
    """Run `mlp` (a dense MLP: gate, up, act, down) on `tiles` consecutive pieces of its positions, keeping only its
    input for backward, which reruns each piece's forward and backward in turn (DeepSpeed's `TiledMLP`): a long row
    never holds its [S, intermediate] activations at once. Its parameters' gradients accumulate piece by piece (so
    not with zero_bubble's deferred weight gradients), and a piece's output must not cross ranks along the sequence
    (not with sequence parallelism's reduce-scatter); training.validate refuses both, and TP altogether (unproven)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    params = [p for p in mlp.parameters() if p.requires_grad]

    def tiled(x: torch.Tensor) -> torch.Tensor:
        return TiledMLP.apply(lambda module, piece: type(module).forward(module, piece), mlp, x, tiles, params)

    mlp.forward = tiled


class _HeadsOf:
    """An attention module as a kernel sees it, with `sinks` cut to the heads this rank attends with."""

    def __init__(self, module, sinks: torch.Tensor):
        self._module, self.sinks = module, sinks

    def __getattr__(self, name):
        return getattr(self._module, name)


def _with_local_sinks(kernel, cp: ContextParallel):
    """`kernel` (the family's eager attention, which adds `module.sinks` per head) on this CP rank's heads: Ulysses
    hands rank r the r-th of C equal blocks of heads, so it sees the same block of sinks; each rank's gradient
    reaches its block only, and the CP sum of gradients (`sum_over_context`'s scaling) makes the whole."""

    def attend(module, query, *args, **kwargs):
        heads = query.shape[1]
        return kernel(_HeadsOf(module, module.sinks[cp.rank * heads : (cp.rank + 1) * heads]), query, *args, **kwargs)

    return attend


def attach(attention: torch.nn.Module, config, cp: ContextParallel, implementation: str) -> None:
    """Route `attention` (a family's transformers attention module, built from `config`: this TP rank's heads)
    through Ulysses over `cp.group`, around the kernel `implementation` would have used. Adds no parameter, buffer
    or state_dict key."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    register_attention()
    if implementation == "eager":  # the family's own eager attention (Llama 4's differs)
        kernel = sys.modules[type(attention).__module__].eager_attention_forward
    else:
        kernel = ALL_ATTENTION_FUNCTIONS[implementation]
    if hasattr(attention, "sinks"):  # gpt-oss: a sink logit per head; this rank attends with its heads only
        kernel = _with_local_sinks(kernel, cp)
    block = getattr(attention, "layer_idx", 0)  # its layer's shape where layers differ (Gemma 4's global layers)
    head_dim = layer_attr(config, block, "head_dim") or config.hidden_size // config.num_attention_heads
    head_dim = getattr(attention, "qk_head_dim", head_dim)  # MLA: query and key heads hold a nope and a rope part
    kv = layer_attr(config, block, "num_key_value_heads")
    shape = (config.num_attention_heads, head_dim, kv, config.num_hidden_layers)
    ulysses = cp.exchanges.get((kernel, cp.group, *shape))
    if ulysses is None:
        ulysses = cp.exchanges[(kernel, cp.group, *shape)] = ulysses_class()(
            attn=kernel,
            batch_size=1,
            attn_head_count=shape[0],
            attn_head_size=head_dim,
            kv_head_count=shape[2],
            num_hidden_layers=shape[3],
            process_group=cp.group,
            seq_length_is_variable=True,
        )
    object.__setattr__(attention, "ulysses", ulysses)  # not a submodule: no keys, not moved or cast by DeepSpeed
    attention.config = copy.copy(config)  # this layer's attention only dispatches to Ulysses
    attention.config._attn_implementation = ATTENTION_KEY
