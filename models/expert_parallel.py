"""Expert parallelism inside a pipeline stage: a sparse block's experts split over E ranks, tokens sent to their
experts and back by all-to-all. Wiring around transformers' own modules, as models/tensor_parallel.py is:

- The block is transformers' (router, experts, shared expert) built with E / ep experts in its experts module
  (`local_experts_config`); the router is rebuilt over all E experts, so routing is unchanged.
- `dispatch_to_experts` replaces the experts module's forward: each (token, top-k slot) goes to the rank holding
  its expert (`all_to_all_single` with split sizes, which gloo and NCCL both run), the local experts run as
  transformers runs them (its `experts_implementation`: one grouped matmul, or its loop) on the rows they
  received, the outputs come back by the reverse all-to-all and are weighted and summed per token as transformers
  does. The all-to-all's backward is the reverse all-to-all, so each expert's gradient sums every token routed to
  it from every rank of the group.

Dropless: no capacity factor, no token dropped, no noise. Model code only: the process group comes from
training/ (no DeepSpeed import).
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.families import family_of


@dataclass
class ExpertParallel:
    """This rank's place among the E ranks of its stage that split each sparse block's experts."""

    size: int = 1
    rank: int = 0
    group: Any = None  # the E ranks that split the experts (all-to-all)
    data_group: Any = None  # the DP / E ranks that hold the same experts (their gradients are reduced there)

    def local_experts(self, num_experts: int) -> range:
        """The experts this rank holds: a contiguous block of num_experts / size."""
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def local_config(self, config):
        """`local_experts_config`: what the decoder layer builds its sparse block from."""
        return local_experts_config(config, self)

    def split(self, block, config, routed: bool = False) -> None:
        """`dispatch_to_experts` on a sparse block built from `local_config` (at size 1 a no-op, unless `routed`
        asks Llama 4's block to run its experts on their routed tokens only)."""
        if self.size > 1 or (routed and family_of(config).moe.scaled_inputs):
            dispatch_to_experts(block, config, self)


class _AllToAll(torch.autograd.Function):
    """`all_to_all_single` with split sizes; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows of `x` in blocks of `in_splits` to each rank; returns the blocks of `out_splits` rows received."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def local_experts_config(config, ep: ExpertParallel):
    """A copy of `config` whose experts module holds this rank's E / ep experts (the router is rebuilt whole)."""
    if ep.size == 1:
        return config
    field = family_of(config).moe.num_experts
    local = copy.copy(config)
    setattr(local, field, getattr(config, field) // ep.size)
    return local


def _exchange(ep: ExpertParallel, flat: torch.Tensor, num_experts: int, rows_of, run_local) -> tuple:
    """Send each (token, slot) row to the rank holding its expert and back. `flat` [N * k]: the expert of each
    slot; `rows_of(order)`: the rows to send, in `order` (the slots sorted by expert, so by rank); `run_local(rows,
    local_id)`: this rank's experts on the rows it received. Returns (order, the rows' outputs in `order`)."""
    per = num_experts // ep.size
    order = torch.argsort(flat, stable=True)
    if ep.size == 1:  # every expert here (Llama 4's routed experts without expert parallelism)
        return order, run_local(rows_of(order), flat[order])
    counts = torch.bincount(flat, minlength=num_experts)  # [E] rows this rank sends to each expert
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=ep.group)  # [ep * per]: from rank r to local expert j
    send = counts.view(ep.size, per).sum(1).tolist()
    recv = received.view(ep.size, per).sum(1).tolist()
    rows = all_to_all(rows_of(order), recv, send, ep.group)  # [M, H]
    local_id = torch.arange(per, device=flat.device).repeat(ep.size).repeat_interleave(received)
    return order, all_to_all(run_local(rows, local_id), send, recv, ep.group)  # [N * k, H] in `order`


def dispatch_to_experts(block, config, ep: ExpertParallel) -> None:
    """Make `block` (a sparse block built from `local_experts_config`) route over all experts and run its local
    ones for every rank of the group (see the module docstring)."""
    family = family_of(config)
    if family.moe.scaled_inputs:
        return _dispatch_scaled_inputs(block, config, ep)
    name = family.moe.router  # the router over every expert, as transformers builds it
    setattr(block, name, type(getattr(block, name))(config))
    experts = block.experts
    local_forward = experts.forward  # transformers' (its experts_implementation), on this rank's experts
    num_experts = getattr(config, family.moe.num_experts)
    bias = family.moe.block_bias  # a score bias of the block's (MiniMax-M2's, LFM2-MoE's): every expert's
    if bias and getattr(block, bias, None) is not None:
        block.register_buffer(bias, getattr(block, bias).new_zeros(num_experts))

    def forward(self, hidden, top_k_index, top_k_weights):  # [N, H], [N, k], [N, k]
        k = top_k_index.shape[1]

        def run_local(rows, local_id):
            return local_forward(
                rows, local_id[:, None], torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
            )

        order, back = _exchange(ep, top_k_index.reshape(-1), num_experts, lambda order: hidden[order // k], run_local)
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        final = torch.zeros_like(hidden)
        return final.index_add_(0, order // k, (back * weights[:, None]).to(final.dtype))

    experts.forward = types.MethodType(forward, experts)


def _dispatch_scaled_inputs(block, config, ep: ExpertParallel) -> None:
    """A block whose router scales the experts' inputs (`MoeSpec.scaled_inputs`: Llama 4's `Llama4TextMoe`) with its
    experts split: transformers runs every expert on every token,
    each token's input scaled by its sigmoid score (0 outside its top-k); here only the top-k (token, expert)
    pairs travel, scaled the same way, and the local experts run as one grouped matmul over the rows they received
    (transformers' `grouped_mm` on Llama 4's x @ W layout). The shared expert runs on every token, as there."""
    from transformers.integrations.moe import _default_apply_gate, grouped_mm_experts_forward

    block.router = type(block.router)(config)  # the router over every expert
    experts = block.experts
    experts.num_experts = experts.gate_up_proj.shape[0]
    # What transformers' grouped_mm reads of an experts module (`use_experts_implementation` sets them on others).
    experts.has_gate, experts.has_bias, experts.is_transposed = True, False, True
    experts.has_post_expert_norm, experts._is_expert_parallel = False, False
    experts._apply_gate = types.MethodType(_default_apply_gate, experts)
    num_experts, top_k = getattr(config, family_of(config).moe.num_experts), config.num_experts_per_tok

    def run_local(rows, local_id):
        ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
        return grouped_mm_experts_forward(experts, rows, local_id[:, None], ones)

    def forward(self, hidden_states):  # [B, S, H] -> ([N, H], router logits [N, E])
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores, logits = self.router(x)  # scores [N, E]: sigmoid of the top-k logits, 0 elsewhere
        index = torch.topk(logits, top_k, dim=1).indices  # the router's own choice
        score = scores.gather(1, index).reshape(-1)  # [N * k]

        def rows_of(order):  # each pair's input scaled by its score, as transformers scales it
            return x[order // top_k] * score[order][:, None]

        order, back = _exchange(ep, index.reshape(-1), num_experts, rows_of, run_local)
        routed = torch.zeros_like(x).index_add_(0, order // top_k, back.to(x.dtype))
        out = self.shared_expert(x)
        return out + routed, logits

    block.forward = types.MethodType(forward, block)
