"""Tensor parallelism inside a pipeline stage: Megatron's split of every decoder block, and vocab-parallel
embedding, LM head and cross-entropy. Wiring around HF's modules, as models/pipeline.py is:

- A block is HF's own decoder layer built from `local_config` (heads / T, KV heads / T, intermediate / T,
  explicit head_dim), so its q/k/v, gate/up hold this rank's rows and o_proj, down_proj its columns.
- The input of the split region is copied (`copy_to_tp`: identity forward, gradient summed over TP
  backward) once, after each RMSNorm, so q/k/v and gate/up share one gradient all-reduce.
- o_proj and down_proj are row-parallel: their partial outputs are summed over TP (`reduce_from_tp`) and
  their bias added once after the sum.
- A replicated parameter used inside the split region (LoRA A of a column layer, a per-head norm) gets a
  partial gradient on each rank: `sum_grad_over_tp` adds the partials, so every rank holds the same one.
- Embedding and LM head hold V_padded / T vocabulary rows; the loss is computed on those shards without any
  rank holding [B, S, V] logits, and padded rows are masked out of it.

Stage outputs are therefore identical on every TP rank, which DeepSpeed's pipeline engine requires to
partition them across the TP group for the stage-to-stage send.

Sequence parallelism (`TensorParallel.sequence_parallel`; Megatron's, Korthikanti et al. 2022): between the
split regions each TP rank holds S/T positions of [B, S, H] instead of all S. Entering a split region
all-gathers the sequence (`gather_sequence`; backward: reduce-scatter) instead of copying; leaving it
reduce-scatters (`scatter_sequence`; backward: all-gather) instead of all-reducing, the same volume. The
embedding's partial sums are reduce-scattered, every RMSNorm and residual add works on the shard, the stage
sends its own shard to the next, and the LM head gathers the sequence before the vocab-parallel loss.
Replicated parameters used on the shard (the RMSNorms, row-parallel biases, LoRA B of row layers) see only
their rank's positions, so their gradients are summed over TP as well.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.carry import per_layer_params, stream_mixer_params
from models.families import family_of
from models.head import LMHeadPipe, head_output, set_logit_rules, tied_lm_head_forward
from models.layer_config import global_attr, layer_attr
from models.layer_kinds import residual_streams
from models.layers import (
    DecoderOptions,
    EmbeddingPipe,
    decoder_layer_class,
    embedded,
    embedding_setup,
    layer_class_and_args,
    norm_class,
)
from models.loss import HeadOutput
from models.moe import dense_mlp
from models.pipe_layout import DECODER, EMBED, LM_HEAD, NORM, PipeLayer
from models.sharding import LINEAR_HEADS, padded_vocab, tp_indivisible
from models.tp_collectives import SumOverTP, TensorParallel, copy_to_tp, enter_tp, leave_tp, sum_grad_over_tp
from models.tp_rules import attention_replicas, row_layer
from models.vocab_parallel_loss import vocab_parallel_token_cross_entropy


def local_config(config, tp: TensorParallel):
    """A copy of `config` describing this rank's shard of every block (same head_dim, fewer heads)."""
    heads, kv = config.num_attention_heads, global_attr(config, "num_key_value_heads")
    bad = tp_indivisible(config, tp.size)
    if bad:
        raise ValueError(f"{bad[0]}={bad[1]} does not split into tensor_parallel_size={tp.size} equal parts")
    local = copy.deepcopy(config)
    local.head_dim = global_attr(config, "head_dim") or config.hidden_size // heads
    if not family_of(config).replicated_attention:  # (DeepSeek-V4's attention: whole on every rank)
        local.num_attention_heads, local.num_key_value_heads = heads // tp.size, kv // tp.size
    for layer in getattr(getattr(local, "_heterogeneity_spec", None), "per_layer_overrides", {}).values():
        if "num_key_value_heads" in layer:  # a layer of its own shape (Gemma 4's global layers)
            layer["num_key_value_heads"] //= tp.size
    local.intermediate_size = config.intermediate_size // tp.size
    if getattr(config, "block_auto_adjust_ff_dim", False):  # LFM2's MLP width derived from intermediate_size
        width = derived_mlp_width(config)
        if width % tp.size:
            raise ValueError(f"the MLP's width {width} does not split into tensor_parallel_size={tp.size} equal parts")
        local.intermediate_size, local.block_auto_adjust_ff_dim = width // tp.size, False
    widths = ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp")  # as MLPs are
    for name in (*widths, *LINEAR_HEADS):  # and linear attention's heads, as attention's
        if getattr(config, name, None):
            setattr(local, name, getattr(config, name) // tp.size)
    local._attn_implementation = config._attn_implementation
    return local


def derived_mlp_width(config) -> int:
    """The width of a dense MLP whose family derives it from `intermediate_size` (LFM2's `block_auto_adjust_ff_dim`),
    as transformers' MLP module builds it."""
    with torch.device("meta"):
        mlp = family_of(config).hf_class("MLP")(config)
    return max(m.out_features for m in mlp.modules() if isinstance(m, nn.Linear))


class RowParallelLinear(nn.Linear):
    """Input columns sharded; partial outputs summed over TP, then the (replicated) bias added once."""

    tp: TensorParallel
    matmul = staticmethod(F.linear)  # (x, weight) -> x W^T; models/weight_grad.py may defer its weight gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = leave_tp(self.matmul(x, self.weight), self.tp)
        return out if self.bias is None else out + self.bias


def _row_parallel(linear: nn.Linear, tp: TensorParallel) -> RowParallelLinear:
    linear.__class__ = RowParallelLinear  # same parameters and state_dict keys, row-parallel forward
    linear.tp = tp
    if tp.sp and linear.bias is not None:  # added on this rank's positions only
        sum_grad_over_tp(linear.bias, tp)
    return linear


class TPDecoderPipe:
    """Mixin: a family's pipeline decoder block holding this rank's shard (Megatron's split); see the module
    docstring. Qwen3's per-head q/k norms are replicated but see only this rank's heads: their gradients
    are summed over TP so they stay identical on every rank. A linear-attention block (Gated DeltaNet) holds its
    rank's key and value heads, whose recurrences are independent: its projections and convolution split by heads,
    out_proj is row-parallel and the gated norm's gradient is summed over TP. Under sequence parallelism the block's
    input and output are this rank's S/T positions, and so are the two RMSNorms' (their gradients summed over TP
    too); the recurrence sees the whole row, gathered after the input norm."""

    def __init__(
        self, config, layer_idx: int, tp: TensorParallel, options: DecoderOptions | None = None, ep=None
    ) -> None:
        local = local_config(config, tp)
        super().__init__(local, layer_idx, options, ep)
        self.tp = tp
        if self.linear and config.layer_types[layer_idx] == "conv":  # LFM2's short convolution over its channels
            _split_short_convolution(self.conv, tp)
        elif self.linear:  # Gated DeltaNet with this rank's key and value heads; its gated norm sees only their values
            _row_parallel(self.linear_attn.out_proj, tp)
            sum_grad_over_tp(self.linear_attn.norm.weight, tp)
        elif family_of(config).replicated_attention:  # whole on every rank: the same inputs, outputs and gradients
            if tp.sp:  # it sees the whole row, gathered, and gives back this rank's positions of its output
                self._replicate_attention_on_positions(tp)
        else:
            self._split_attention(config, local, tp)
        moe = family_of(config).moe
        if self.sparse:
            split_sparse_block(self.moe_block(), tp, moe.router, moe.router_logits, self if moe.beside_mlp else None)
        if not self.sparse or moe.beside_mlp:  # (Gemma 4's experts sit beside a dense MLP of its own)
            mlp = getattr(self, dense_mlp(config))
            _row_parallel(row_layer(mlp, dense_mlp(config), config), tp)  # down_proj (LFM2's w2)
            # Parameters of the MLP's other modules (Apertus's xIELU scalars) act on this rank's columns only.
            for module in mlp.modules():
                if not isinstance(module, nn.Linear):
                    for param in module.parameters(recurse=False):
                        sum_grad_over_tp(param, tp)
        family = family_of(config)
        for name in family.norms:
            norm = getattr(self, name, None)
            if norm is None:  # a norm of an optional part the model has not (Gemma 4's PLE norm without PLE)
                continue
            if name in family.tp_entry_norms:  # its output is the input of q/k/v or of gate/up (or of the experts)
                norm.register_forward_hook(lambda _module, _inputs, out: self.enter(out))
            if tp.sp:
                sum_grad_over_tp(norm.weight, tp)
        if tp.sp:  # replicated modules outside the split regions see this rank's positions only (Gemma 4's PLE,
            for param in per_layer_params(self) + stream_mixer_params(self, config):  # DeepSeek-V4's streams' mixers)
                sum_grad_over_tp(param, tp)
        if not family.tp_entry_norms:  # no norm before attention or the MLP: the split regions start at their inputs
            for region in (self.self_attn, getattr(self, dense_mlp(config))):
                region.register_forward_pre_hook(self._enter_region, with_kwargs=True)

    def _replicate_attention_on_positions(self, tp: TensorParallel) -> None:
        """Sequence parallelism around an attention kept whole on every rank (DeepSeek-V4's): its input gathered
        (backward: the ranks' gradients reduce-scattered), its output cut to this rank's positions, and its
        parameters' gradients, each rank's from its own positions' outputs, summed over TP."""
        self.self_attn.register_forward_pre_hook(self._enter_region, with_kwargs=True)
        self.self_attn.register_forward_hook(lambda _module, _args, out: (self.own_positions(out[0]), *out[1:]))
        for param in self.self_attn.parameters():
            if param.requires_grad:
                sum_grad_over_tp(param, tp)

    def _split_attention(self, config, local, tp: TensorParallel) -> None:
        width = local.num_attention_heads * layer_attr(local, self.self_attn.layer_idx, "head_dim")
        o_proj = row_layer(self.self_attn, "self_attn", config)  # o_proj (LFM2's out_proj)
        name = next(n for n, m in self.self_attn.named_children() if m is o_proj)
        if o_proj.in_features == config.hidden_size != width:  # declared hidden x hidden (Helium's): this rank's heads
            setattr(self.self_attn, name, nn.Linear(width, o_proj.out_features, bias=o_proj.bias is not None))
        _row_parallel(getattr(self.self_attn, name), tp)
        for param in attention_replicas(self.self_attn, config):
            sum_grad_over_tp(param, tp)
        family = family_of(config)
        if family.has(family.qk_norm, config):
            for name, heads in (("q_norm", "num_attention_heads"), ("k_norm", "num_key_value_heads")):
                norm = getattr(self.self_attn, name, None)
                if norm is None:
                    continue
                if family.qk_norm_whole:  # this rank's rows of the weight; the statistics of every rank's heads
                    idx = self.self_attn.layer_idx
                    rows = layer_attr(local, idx, heads) * layer_attr(local, idx, "head_dim")
                    if norm.weight.shape[0] != rows:  # declared from hidden_size (OLMoE's): this rank's rows
                        norm.weight = nn.Parameter(norm.weight.new_empty(rows))
                    norm.forward = functools.partial(_whole_projection_norm, norm, tp)
                else:
                    sum_grad_over_tp(norm.weight, tp)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """`enter_tp`; a [B * S, H] tensor (Gemma 4's router and experts see the layer's positions flattened) as the
        [B, S, H] it is, so that sequence parallelism gathers each row's positions."""
        if x.dim() != 2:
            return enter_tp(x, self.tp)
        return enter_tp(x.view(self._batch, -1, x.shape[-1]), self.tp).reshape(-1, x.shape[-1])

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """`leave_tp` of partial sums, a [B * S, H] tensor as `enter` takes it."""
        return leave_tp(x.view(self._batch, -1, x.shape[-1]), self.tp).reshape(-1, x.shape[-1])

    def own_positions(self, x: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism this rank's S/T positions of a whole-row [B, S, ...] tensor."""
        return x.chunk(self.tp.size, dim=1)[self.tp.rank] if self.tp.sp else x

    def _enter_region(self, _module, args, kwargs):
        if args:
            return (enter_tp(args[0], self.tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter_tp(kwargs["hidden_states"], self.tp)}


def _split_short_convolution(conv: nn.Module, tp: TensorParallel) -> None:
    """LFM2's gated short convolution over this rank's H / T channels: in_proj's B, C and x rows of them (its parts
    split one by one, models/tp_rules.py), the depthwise convolution's channels, out_proj row-parallel. Each channel's
    maths is its own (B * x convolved, gated by C), so nothing crosses ranks until out_proj's sum."""
    hidden, width = conv.in_proj.in_features, conv.in_proj.in_features // tp.size
    conv.in_proj = nn.Linear(hidden, 3 * width, bias=conv.in_proj.bias is not None)
    taps = conv.conv.kernel_size[0]
    conv.conv = nn.Conv1d(width, width, taps, groups=width, bias=conv.conv.bias is not None, padding=taps - 1)
    conv.out_proj = _row_parallel(nn.Linear(width, hidden, bias=conv.out_proj.bias is not None), tp)


def _whole_projection_norm(norm: nn.Module, tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm over a whole q or k projection (OLMo's) on this rank's columns of it: the mean of
    squares is the TP group's sum over every rank's columns; the weight is this rank's share."""
    dtype = x.dtype
    x = x.to(torch.float32)
    mean = SumOverTP.apply(x.pow(2).sum(-1, keepdim=True), tp) / (x.shape[-1] * tp.size)
    x = x * torch.rsqrt(mean + norm.variance_epsilon)
    return (norm.weight * x).to(dtype)


def split_sparse_block(
    block: nn.Module, tp: TensorParallel, router: str = "gate", logits_at: int = 0, beside=None
) -> None:
    """A sparse MLP block (transformers' router, fused experts, shared expert) with each expert split as a dense
    MLP is (the layer was built from `local_config`). Its input is whole on every rank (`enter_tp` after the norm),
    its output partial: summed over TP once, after the routed and shared experts are added (`leave_tp`). The router
    (`router`; its logits at `logits_at` of its outputs) is replicated and routes every rank's tokens alike; its
    scores multiply partial expert outputs (Llama 4's: the experts' inputs), so their gradient is summed over TP,
    and the router's whole gradient reaching its (already copied) input is divided by T so that the input's TP sum
    counts it once. A shared expert's gate multiplies the partial shared output: its gradient is summed over TP.
    `beside`: the TP decoder layer whose experts sit beside its dense MLP, the layer itself the block (Gemma 4's): the
    router's input is outside any split region, entered here (its experts' at their own norm), and the experts'
    output, not the layer's, is summed over TP."""

    def router_input(_module, args):
        x = beside.enter(args[0]) if beside is not None else args[0].view_as(args[0])
        if x.requires_grad:
            x.register_hook(lambda grad: grad / tp.size)
        return (x, *args[1:])

    def router_output(_module, _args, out):  # scores beside the logits: Mixtral's, Qwen's top-k weights
        return tuple(copy_to_tp(t, tp) if i == 1 - logits_at else t for i, t in enumerate(out))

    def block_output(_module, inputs, out):  # Llama 4's block returns (hidden [B * S, H], router logits)
        if beside is not None:  # the experts' output [B * S, H]
            return beside.leave(out)
        if isinstance(out, tuple):
            return leave_tp(out[0].view(inputs[0].shape), tp), *out[1:]
        return leave_tp(out, tp)

    getattr(block, router).register_forward_pre_hook(router_input)
    getattr(block, router).register_forward_hook(router_output)
    if hasattr(block, "shared_expert_gate"):
        sum_grad_over_tp(block.shared_expert_gate.weight, tp)
    (block.experts if beside is not None else block).register_forward_hook(block_output)
    if isinstance(getattr(block.experts, "down_proj_bias", None), nn.Parameter):
        _down_bias_once(block.experts, tp)


def _down_bias_once(experts: nn.Module, tp: TensorParallel) -> None:
    """Experts whose down projection has a bias (gpt-oss's [E, H]) add it inside each expert's output, before the
    routing weights and the TP sum: every rank's partial output would carry it, so it counts on TP rank 0 only (zero
    elsewhere, its gradient summed over TP)."""
    bias = experts.down_proj_bias
    sum_grad_over_tp(bias, tp)

    def share(module, _args):
        module._parameters["down_proj_bias"] = bias * float(tp.rank == 0)  # read by transformers' forward

    def restore(module, _args, _out):
        module._parameters["down_proj_bias"] = bias

    experts.register_forward_pre_hook(share)
    experts.register_forward_hook(restore, always_call=True)


@functools.cache
def tp_decoder_layer_class(model_type: str) -> type[nn.Module]:
    """The family's pipeline decoder block holding this rank's shard: `TPDecoderPipe` on `decoder_layer_class`."""
    base = decoder_layer_class(model_type)
    return type(f"TP{base.__name__}", (TPDecoderPipe, base), {"__module__": __name__})


class VocabParallelEmbeddingPipe(EmbeddingPipe):
    """Rows [rank * V_local, (rank + 1) * V_local) of the padded vocabulary; other ids look up zeros, and the
    ranks' outputs are summed."""

    def __init__(self, config, tp: TensorParallel):
        nn.Embedding.__init__(
            self, padded_vocab(config.vocab_size, tp.size, tp.vocab_multiple) // tp.size, config.hidden_size
        )
        embedding_setup(self, config)
        self.tp, self.start = tp, tp.rank * self.num_embeddings
        pad = config.pad_token_id
        if pad is not None and self.start <= pad < self.start + self.num_embeddings:
            self.padding_idx = pad - self.start  # as HF's embedding: no gradient into the pad row

    def forward(self, inputs):
        input_ids, *rest = inputs  # [B, S]; position_ids [B, S] (and lengths [B] with experts)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)  # [B, S, H]
        hidden = leave_tp(hidden.masked_fill(outside[..., None], 0.0), self.tp)  # [B, S/T, H] under SP
        return embedded(self, hidden, input_ids, rest)


class VocabParallelLMHeadPipe(LMHeadPipe):
    """This rank's V_local rows of the output projection: logits [B, S, V_local] for `VocabParallelLoss`."""

    def __init__(self, config, tp: TensorParallel):
        nn.Linear.__init__(
            self, config.hidden_size, padded_vocab(config.vocab_size, tp.size, tp.vocab_multiple) // tp.size, bias=False
        )
        self.tp = tp
        set_logit_rules(self, config)

    def forward(self, hidden: torch.Tensor | tuple) -> HeadOutput | tuple:
        return head_output(hidden, self, functools.partial(enter_tp, tp=self.tp))


class TiedVocabParallelHead:
    """`TiedLayerSpec.forward_fn` of a tied, vocab-parallel LM head: the embedding's local rows as output rows."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, embedding: nn.Embedding, hidden: torch.Tensor | tuple) -> HeadOutput | tuple:
        return head_output(hidden, embedding, functools.partial(enter_tp, tp=self.tp))


class SequenceParallelNorm:
    """Mixin: the final RMSNorm on this rank's S/T positions (sequence parallelism): its gradient summed over TP."""

    def __init__(self, config, tp: TensorParallel):
        super().__init__(config)
        head = self.hc_head.parameters() if residual_streams(config) > 1 else ()  # DeepSeek-V4's stream head
        for param in (self.weight, *head):
            sum_grad_over_tp(param, tp)


@functools.cache
def sp_norm_class(model_type: str) -> type[nn.Module]:
    base = norm_class(model_type)
    return type(f"SP{base.__name__}", (SequenceParallelNorm, base), {"__module__": __name__})


def vocab_parallel(config, tp: TensorParallel) -> bool:
    """Whether embedding and head are vocab-parallel: split over TP ranks, or padded (`model.vocab_pad_multiple`)."""
    return tp.size > 1 or padded_vocab(config.vocab_size, tp.size, tp.vocab_multiple) != config.vocab_size


def token_cross_entropy_for(config, tp: TensorParallel):
    """The per-token cross-entropy the last stage uses: None (torch's, on whole logits), or the vocab-parallel one
    when the head is split or padded."""
    if not vocab_parallel(config, tp):
        return None
    return functools.partial(vocab_parallel_token_cross_entropy, tp=tp, vocab_size=config.vocab_size)


def tp_layer_class_and_args(
    layer: PipeLayer, config, tp: TensorParallel, options: DecoderOptions | None = None, ep=None
) -> tuple[type[nn.Module], tuple]:
    """`models.layers.layer_class_and_args` with this rank's shard of each layer (and with `ep`, a
    `models.expert_parallel.ExpertParallel`, its experts of each sparse block)."""
    if layer.kind == DECODER and tp.size > 1:
        return tp_decoder_layer_class(family_of(config).model_type), (config, layer.block, tp, options, ep)
    if layer.kind == EMBED or (layer.kind == LM_HEAD and not layer.has_file):  # a tied head uses the embedding
        return (VocabParallelEmbeddingPipe, (config, tp)) if vocab_parallel(config, tp) else (EmbeddingPipe, (config,))
    if layer.kind == LM_HEAD and vocab_parallel(config, tp):
        return VocabParallelLMHeadPipe, (config, tp)
    if layer.kind == NORM and tp.sp:
        return sp_norm_class(family_of(config).model_type), (config, tp)
    return layer_class_and_args(layer, config, options, ep)


def tp_tied_head_forward(config, tp: TensorParallel):
    """`TiedLayerSpec.forward_fn` of the tied LM head."""
    return TiedVocabParallelHead(tp) if vocab_parallel(config, tp) else tied_lm_head_forward
