"""Tensor parallelism's collectives (Megatron's f and g, and their sequence-parallel forms): entering a split region
copies its input (identity forward, the gradient summed over TP backward) or, under sequence parallelism, gathers
the sequence; leaving it sums the ranks' partial results (or reduce-scatters them to this rank's positions). A
replicated parameter used inside a split region gets its partial gradients summed over TP. models/tensor_parallel.py
wires them around transformers' layers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from models.sequence_parallel import gather_sequence, scatter_sequence


@dataclass
class TensorParallel:
    """This rank's place in its tensor-parallel group. `group` is set once the process group exists."""

    size: int = 1
    rank: int = 0
    vocab_multiple: int = 1  # pad the vocabulary to a multiple of this (and of `size`)
    group: Any = None
    sequence_parallel: bool = False  # shard the sequence between the split regions (size > 1 only)

    @property
    def sp(self) -> bool:
        """Whether the sequence is sharded between split regions."""
        return self.sequence_parallel and self.size > 1


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> None:
    """Sum `x` over the TP group in place. On the meta device tensors have shapes only and nothing is sent: the
    memory planner runs this rank's split blocks there (tools/activation_bytes.py)."""
    if not x.is_meta:
        dist.all_reduce(x, group=tp.group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        x = x.contiguous().clone()
        all_reduce(x, tp)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def enter_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of a split region: the whole sequence on every rank (gathered under sequence parallelism)."""
    return gather_sequence(x, tp) if tp.sp else copy_to_tp(x, tp)


def leave_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Partial results of a split region summed over TP: this rank's positions under sequence parallelism."""
    return scatter_sequence(x, tp) if tp.sp else reduce_from_tp(x, tp)


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Enter a split region: identity forward, the gradient summed over TP ranks backward."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Leave a split region: the partial results summed over TP ranks forward, identity backward."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


def sum_grad_over_tp(param: nn.Parameter, tp: TensorParallel) -> None:
    """A replicated parameter used inside a split region: sum its per-rank partial gradients."""
    if tp.size == 1:
        return

    def hook(grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp.group)
        return grad

    param.register_hook(hook)
    param.grad_summed_by_hook = True  # models/weight_grad.py leaves its gradient to autograd, where the hook runs


class SumOverTP(torch.autograd.Function):
    """A sum over the TP group that every rank's result depends on: all-reduced forward, and its gradient (each
    rank's share of it) all-reduced backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        x = x.contiguous().clone()
        all_reduce(x, tp)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.tp)
        return grad, None
