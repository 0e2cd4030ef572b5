"""The training loss: fp32 cross-entropy summed over target tokens, scaled to a global token mean.

Model code only: no DeepSpeed import, so data code and tests can use `IGNORE_INDEX` and the loss alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy summed over the labels that are not IGNORE_INDEX ([B, S, V] logits, [B, S] labels)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


class _ChunkedLoss(torch.autograd.Function):
    """Summed cross-entropy computed `chunk` tokens at a time, its gradient taken chunk by chunk in forward.

    Only one chunk's fp32 logits and softmax exist at any moment; what is kept for backward is the
    gradient with respect to the logits, in the logits' own dtype (the size of the logits, which the
    pipeline holds anyway). `cross_entropy` may contain collectives (the vocab-parallel one): every
    tensor-parallel rank runs the same chunks in the same order.
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk, cross_entropy):
        flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        grad = torch.empty_like(flat_logits)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        for start in range(0, flat_labels.numel(), chunk):
            piece = flat_logits[start : start + chunk].detach().requires_grad_()
            with torch.enable_grad():
                loss = cross_entropy(piece[None], flat_labels[start : start + chunk][None])
            (grad[start : start + chunk],) = torch.autograd.grad(loss, piece)
            total += loss.detach().float()
        ctx.save_for_backward(grad)
        ctx.shape = logits.shape
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad,) = ctx.saved_tensors
        return (grad * grad_total.to(grad.dtype)).reshape(ctx.shape), None, None, None


def chunked_cross_entropy(logits, labels, chunk: int, cross_entropy=summed_cross_entropy) -> torch.Tensor:
    """`cross_entropy(logits, labels)` (summed over tokens) without whole-batch fp32 logits: see `_ChunkedLoss`."""
    if not torch.is_grad_enabled() or not logits.requires_grad:
        with torch.no_grad():
            flat_logits, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
            pieces = [
                cross_entropy(flat_logits[i : i + chunk][None], flat_labels[i : i + chunk][None]).float()
                for i in range(0, flat_labels.numel(), chunk)
            ]
            return torch.stack(pieces).sum()
    return _ChunkedLoss.apply(logits, labels, chunk, cross_entropy)


class CausalLMLoss:
    """fp32 cross-entropy summed over scored tokens, times a per-step scale.

    Labels arrive already shifted (labels[t] is the target of position t; see `data.collator`),
    together with `scale` = (micro-batches x DP size) / (target tokens in the whole global
    batch). DeepSpeed divides each micro-batch loss by the micro-batch count and averages
    gradients over DP ranks, so the optimizer sees the gradient of the mean loss over every
    target token of the step, however tokens fall across micro-batches. A micro-batch with no
    target token adds exactly 0.

    `totals()` returns the (summed loss, token count) seen since the last `reset()`: the exact
    token-weighted figures for evaluation. They accumulate as tensors on the logits' device, so a
    training micro-batch costs no device-to-host copy (a GPU pipeline never stalls on them); only
    `totals()` reads them back.

    Args:
        cross_entropy: (logits, labels) -> cross-entropy summed over non-ignored labels; default torch's.
            Tensor parallelism passes the vocab-parallel one (models/tensor_parallel.py).
        chunk: > 0: compute it `chunk` tokens at a time (`chunked_cross_entropy`); 0: all at once.
    """

    __name__ = "CausalLMLoss"

    def __init__(self, cross_entropy=None, chunk: int = 0):
        self.cross_entropy = cross_entropy or summed_cross_entropy
        self.chunk = chunk
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None  # fp64 [] on the logits' device
        self.tokens: torch.Tensor | None = None  # int64 []

    def totals(self) -> tuple[float, int]:
        if self.loss_sum is None:
            return 0.0, 0
        return float(self.loss_sum), int(self.tokens)

    def __call__(self, logits: torch.Tensor, labels_and_scale) -> torch.Tensor:
        labels, scale = labels_and_scale  # [B, S] long, [] float
        if self.chunk:
            loss_sum = chunked_cross_entropy(logits, labels, self.chunk, self.cross_entropy)
        else:
            loss_sum = self.cross_entropy(logits, labels)
        counted = (labels != IGNORE_INDEX).sum()
        if self.loss_sum is None:
            self.loss_sum, self.tokens = loss_sum.detach().double(), counted
        else:
            self.loss_sum, self.tokens = self.loss_sum + loss_sum.detach().double(), self.tokens + counted
        return loss_sum * scale.to(loss_sum.device)
