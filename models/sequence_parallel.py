"""Sequence parallelism's collectives along the sequence dimension of [B, S, ...] tensors (Megatron's, Korthikanti
et al. 2022): entering a tensor-parallel split region all-gathers the TP ranks' S/T positions (backward:
reduce-scatter), leaving it reduce-scatters the partial sums to each rank's positions (backward: all-gather).
Rank r holds positions [r * S/T, (r + 1) * S/T). `tp` is a `models.tensor_parallel.TensorParallel` (its size and
group), where these are used.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather_sequence(x: torch.Tensor, tp) -> torch.Tensor:
    """[B, S/T, ...] on each rank -> [B, S, ...], the ranks' shards in rank order."""
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # [T*B, S/T, ...]
    if not x.is_meta:  # on the meta device only shapes are planned (tools/activation_bytes.py)
        dist.all_gather_into_tensor(out, x, group=tp.group)
    out = out.view(tp.size, *x.shape).transpose(0, 1)  # [B, T, S/T, ...]
    return out.reshape(x.shape[0], tp.size * x.shape[1], *x.shape[2:])


def _reduce_scatter_sequence(x: torch.Tensor, tp) -> torch.Tensor:
    """[B, S, ...] partial sums on each rank -> [B, S/T, ...]: this rank's positions of the sum over ranks."""
    b, s = x.shape[:2]
    pieces = x.reshape(b, tp.size, s // tp.size, *x.shape[2:]).transpose(0, 1).contiguous()  # [T, B, S/T, ...]
    out = torch.empty(pieces.shape[1:], dtype=x.dtype, device=x.device)
    if not x.is_meta:
        dist.reduce_scatter_tensor(out, pieces.view(tp.size * b, *pieces.shape[2:]), group=tp.group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_sequence(grad, ctx.tp), None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_sequence(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_sequence(grad, ctx.tp), None


def gather_sequence(x: torch.Tensor, tp) -> torch.Tensor:
    """Enter a split region under sequence parallelism: [B, S/T, H] -> [B, S, H] (backward: reduce-scatter)."""
    return _GatherSequence.apply(x, tp)


def scatter_sequence(x: torch.Tensor, tp) -> torch.Tensor:
    """Leave a split region under sequence parallelism: partial [B, S, H] -> summed [B, S/T, H] (backward:
    all-gather)."""
    return _ScatterSequence.apply(x, tp)
