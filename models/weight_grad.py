"""Deferred weight gradients, for zero-bubble pipeline schedules (training/schedules.py).

A linear layer's backward has two halves: the gradient of its input (what the previous layer, and the previous
pipeline stage, wait for) and the gradient of its weight (what only the optimizer step needs). With a
`WeightGradStore` active, every linear layer of a decoder block (the HF projections, the tensor-parallel column
and row layers, LoRA's A and B) returns its input gradient at once and queues the weight-gradient computation;
`run_oldest()` computes the queued gradients of the oldest backward later (the schedule's W pass), with the same
matrix products autograd would use, and accumulates them into `.grad` in the same order.

Model code only: no distributed code (the row-parallel reduction stays in models/tensor_parallel.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class WeightGradStore:
    """Weight-gradient work deferred by the backward passes run while `active`, one group per backward."""

    def __init__(self):
        self.active = False
        self._current: list[Callable[[], None]] = []
        self._groups: deque[list[Callable[[], None]]] = deque()

    def defer(self, work: Callable[[], None]) -> None:
        self._current.append(work)

    def close_backward(self) -> None:
        """The backward that was running is over: what it deferred is one group (one W pass)."""
        self._groups.append(self._current)
        self._current = []

    def run_oldest(self) -> None:
        """Compute the weight gradients of the oldest backward still waiting."""
        for work in self._groups.popleft():
            work()

    @property
    def waiting(self) -> int:
        return len(self._groups)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def _weight_grads(x: torch.Tensor, grad: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
    flat_grad = grad.reshape(-1, grad.shape[-1])  # [N, out]
    if weight.requires_grad:
        _accumulate(weight, flat_grad.t().mm(x.reshape(-1, x.shape[-1])))  # [out, in], autograd's addmm product
    if bias is not None and bias.requires_grad:
        _accumulate(bias, flat_grad.sum(0))


class _DeferredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x, weight)
        # The parameters themselves, to accumulate into: a saved tensor comes back as a detached copy of the
        # parameter when the block is recomputed (activation checkpointing), and its .grad would be lost.
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            param, bias = ctx.weight, ctx.bias
            if ctx.store.active:
                ctx.store.defer(lambda: _weight_grads(x, grad, param, bias))
            else:
                _weight_grads(x, grad, param, bias)
        return grad_x, None, None, None


def deferred_linear(
    x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, store: WeightGradStore
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose weight and bias gradients go through `store`."""
    return _DeferredLinear.apply(x, weight, bias, store)


def defer_weight_gradients(modules, store: WeightGradStore) -> int:
    """Route the weight gradients of every linear layer inside `modules` through `store`. A linear layer whose
    forward adds more (the row-parallel layer's reduction) declares a `matmul` attribute (x, weight) -> x W^T
    that is replaced instead of the whole forward. A weight whose gradient a hook post-processes
    (`grad_summed_by_hook`: LoRA's A on a tensor-parallel column layer, summed over TP) stays with autograd:
    hooks do not see gradients written by a W pass. A subclass with a forward of its own and no `matmul` stays with
    autograd too. Returns the number of layers deferred."""
    count = 0
    for module in modules:
        for layer in module.modules():
            if not isinstance(layer, nn.Linear) or getattr(layer.weight, "grad_summed_by_hook", False):
                continue
            if not isinstance(layer.weight, torch.Tensor):
                continue  # a frozen weight held otherwise (QLoRA's NF4, models/nf4.py): no weight gradient to defer
            if type(layer).forward is not nn.Linear.forward and not hasattr(layer, "matmul"):
                continue  # a linear layer of other maths (DeepSeek-V4's grouped projection, Llama 4's router)
            if hasattr(layer, "matmul"):
                layer.matmul = lambda x, weight, store=store: deferred_linear(x, weight, None, store)
            else:
                layer.forward = lambda x, layer=layer, store=store: deferred_linear(x, layer.weight, layer.bias, store)
            count += 1
    return count
