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

    def split(self, block, config) -> None:
        """`dispatch_to_experts` on a sparse block built from `local_config` (a no-op at size 1)."""
        if self.size > 1:
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


def dispatch_to_experts(block, config, ep: ExpertParallel) -> None:
    """Make `block` (a sparse block built from `local_experts_config`) route over all experts and run its local
    ones for every rank of the group (see the module docstring)."""
    family = family_of(config)
    block.gate = type(block.gate)(config)  # the router over every expert, as transformers builds it
    experts = block.experts
    local_forward = experts.forward  # transformers' (its experts_implementation), on this rank's experts
    num_experts, per = getattr(config, family.moe.num_experts), getattr(config, family.moe.num_experts) // ep.size

    def forward(self, hidden, top_k_index, top_k_weights):  # [N, H], [N, k], [N, k]
        n, k = top_k_index.shape
        flat = top_k_index.reshape(-1)  # [N * k] expert of each (token, slot)
        order = torch.argsort(flat, stable=True)  # by expert, so by the rank that holds it
        token = order // k
        counts = torch.bincount(flat, minlength=num_experts)  # [E] rows this rank sends to each expert
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=ep.group)  # [ep * per]: from rank r to local expert j
        send = counts.view(ep.size, per).sum(1).tolist()
        recv = received.view(ep.size, per).sum(1).tolist()
        rows = all_to_all(hidden[token], recv, send, ep.group)  # [M, H]
        local_id = torch.arange(per, device=hidden.device).repeat(ep.size).repeat_interleave(received)
        out = local_forward(rows, local_id[:, None], torch.ones(len(rows), 1, dtype=hidden.dtype, device=rows.device))
        back = all_to_all(out, send, recv, ep.group)  # [N * k, H] in `order`
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        final = torch.zeros_like(hidden)
        return final.index_add_(0, token, (back * weights[:, None]).to(final.dtype))

    experts.forward = types.MethodType(forward, experts)
