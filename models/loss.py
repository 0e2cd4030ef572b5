"""The training loss: fp32 cross-entropy summed over target tokens, scaled to a global token mean; and the LM head
fused with it over token tiles.

The LM head and the loss as one operation over token tiles: a tile's logits are made, used and dropped, so no
[B, S, V] tensor exists (Liger's fused linear cross-entropy, Apple's Cut Cross-Entropy, DeepSpeed ALST's tiled loss).

The head layer hands the loss a `HeadOutput`: its input and how to make logits from it, not the logits. A summed
loss (SFT) takes each tile's gradient in forward and keeps it in the hidden size ([N, H]) and the head's weight size
([V, H], fp32); a per-token loss whose gradient is known only later (DPO's log-probs) recomputes each tile's logits in
backward. A plain logits tensor goes through the same functions (`as_head`, the projection being the identity):
that is `model.loss_chunk_size` on unfused logits, whose gradient [N, V] is then what is kept.

`cross_entropy` may hold collectives (the vocab-parallel one): every tensor-parallel rank runs the same tiles in the
same order (their hidden states and labels are the same: the head gathered the sequence first).

Model code only: no DeepSpeed import, so data code and tests can use `IGNORE_INDEX` and the loss alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy summed over the labels that are not IGNORE_INDEX ([B, S, V] logits, [B, S] labels)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


TILE_LOGIT_ELEMENTS = 1 << 26  # one tile's fp32 logits: 256 MiB


@dataclass(eq=False)
class HeadOutput:
    """What the last stage's head returns. hidden: [B, S, H] (under sequence parallelism the whole sequence, gathered);
    project: hidden [..., H] -> logits [..., V] (a vocab shard under tensor parallelism, soft-capped where the family
    caps); vocab: the logits' width; params: the parameters `project` reads, whose gradients the tiled functions
    compute."""

    hidden: torch.Tensor
    project: Callable[[torch.Tensor], torch.Tensor]
    vocab: int  # the logits' last dimension
    params: tuple[torch.Tensor, ...] = ()

    def logits(self) -> torch.Tensor:
        """The whole [B, S, V] logits (what the unfused path and the tests' comparisons use)."""
        return self.project(self.hidden)

    def release(self) -> None:
        """Drop the hidden states once the loss has them (DeepSpeed's last stage keeps its output in a buffer until
        the next step overwrites it: what backward needs, the loss's autograd function keeps itself)."""
        self.hidden = None

    def __post_init__(self):
        self.device = self.hidden.device  # (kept after `release`)


def as_head(logits: torch.Tensor | HeadOutput) -> HeadOutput:
    """`logits` as a `HeadOutput` whose projection is the identity (a tensor), or itself."""
    return logits if isinstance(logits, HeadOutput) else HeadOutput(logits, _identity, logits.shape[-1])


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def default_tile(vocab: int) -> int:
    """Tokens per tile when `model.loss_chunk_size` is 0: the largest power of two whose fp32 logits of `vocab`
    columns stay within TILE_LOGIT_ELEMENTS, at least 128 (1,024 tokens at a 49k vocabulary, 512 at 128k)."""
    tokens = max(TILE_LOGIT_ELEMENTS // max(vocab, 1), 1)
    return max(1 << (tokens.bit_length() - 1), 128)


def _tiles(labels: torch.Tensor, tile: int) -> list[tuple[int, int]]:
    """(start, stop) of each tile of the flat labels. Tiles of ignored labels are computed too: skipping them would
    read the labels back to the host, which stalls a GPU pipeline every micro-batch."""
    n = labels.numel()
    return [(start, min(start + tile, n)) for start in range(0, n, tile)]


def _trainable(head: HeadOutput) -> list[torch.Tensor]:
    return [p for p in head.params if p.requires_grad]


def _tile_gradients(hidden, labels, tile, project, loss_fn, params, want_hidden: bool, grad=None):
    """Each tile's loss and its gradients: (the hidden states' gradient or None, the trained `params`' fp32
    gradients, the fp32 summed loss). `grad`: what each tile's loss is multiplied by (None: 1; a scalar for a summed
    loss; [N] for per-token losses)."""
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    trained = [p for p in params if p.requires_grad]
    grad_hidden = torch.zeros_like(flat) if want_hidden else None
    grad_params = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in trained]
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start, stop in _tiles(flat_labels, tile):
        piece = flat[start:stop].detach().requires_grad_(want_hidden)
        with torch.enable_grad():
            loss = loss_fn(project(piece)[None], flat_labels[start:stop][None])
            out = grad if grad is None or grad.dim() == 0 else grad.reshape(-1)[start:stop]
            loss = loss.reshape(-1) if out is not None and out.dim() else loss
            wrt = ([piece] if want_hidden else []) + trained
            grads = list(torch.autograd.grad(loss, wrt, None if out is None else out.to(loss.dtype), allow_unused=True))
        if want_hidden:
            grad_hidden[start:stop] = grads.pop(0)
        for acc, g in zip(grad_params, grads, strict=True):
            if g is not None:
                acc += g
        total += loss.detach().float().sum()
    return grad_hidden, grad_params, total


class _TiledSummedLoss(torch.autograd.Function):
    """`loss(project(hidden), labels)` summed over tokens, tile by tile, every gradient taken in forward."""

    @staticmethod
    def forward(ctx, hidden, labels, tile, project, loss_fn, *params):
        grad_hidden, grad_params, total = _tile_gradients(
            hidden, labels, tile, project, loss_fn, params, hidden.requires_grad
        )
        ctx.save_for_backward(*([grad_hidden] if grad_hidden is not None else []), *grad_params)
        ctx.has_hidden, ctx.trained = grad_hidden is not None, [p.requires_grad for p in params]
        ctx.shape, ctx.dtypes = hidden.shape, [p.dtype for p in params if p.requires_grad]
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved, grad_hidden = list(ctx.saved_tensors), None
        if ctx.has_hidden:
            kept = saved.pop(0)
            if ctx.trained:  # a head's input [N, H]: scaled in fp32 (the scale not rounded)
                grad_hidden = (kept.float() * grad_total).to(kept.dtype).reshape(ctx.shape)
            else:  # plain logits [N, V]: no fp32 copy of them
                grad_hidden = (kept * grad_total.to(kept.dtype)).reshape(ctx.shape)
        grads = iter((g * grad_total).to(dtype) for g, dtype in zip(saved, ctx.dtypes, strict=True))
        params = [next(grads) if trained else None for trained in ctx.trained]
        return (grad_hidden, None, None, None, None, *params)


class _Recomputed(torch.autograd.Function):
    """`loss(project(hidden), labels)` tile by tile, summed (`summed`) or per token [N]; backward recomputes each
    tile's logits, so nothing beyond the head's input is kept."""

    @staticmethod
    def forward(ctx, hidden, labels, tile, project, loss_fn, summed, *params):
        ctx.save_for_backward(hidden, labels)
        ctx.tile, ctx.project, ctx.loss_fn, ctx.params = tile, project, loss_fn, params
        return _losses(hidden, labels, tile, project, loss_fn, summed)

    @staticmethod
    def backward(ctx, grad):
        hidden, labels = ctx.saved_tensors
        grad_hidden, grad_params, _ = _tile_gradients(
            hidden, labels, ctx.tile, ctx.project, ctx.loss_fn, ctx.params, ctx.needs_input_grad[0], grad
        )
        done = iter(g.to(p.dtype) for g, p in zip(grad_params, (p for p in ctx.params if p.requires_grad), strict=True))
        params = [next(done) if p.requires_grad else None for p in ctx.params]
        out = grad_hidden.view(hidden.shape) if grad_hidden is not None else None
        return (out, None, None, None, None, None, *params)


def _losses(hidden, labels, tile, project, loss_fn, summed: bool) -> torch.Tensor:
    """The loss without gradients, tile by tile: summed (fp32 []) or per token (fp32 [*labels.shape])."""
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    per_token = None if summed else torch.zeros(flat_labels.shape, dtype=torch.float32, device=hidden.device)
    with torch.no_grad():
        for start, stop in _tiles(flat_labels, tile):
            loss = loss_fn(project(flat[start:stop])[None], flat_labels[start:stop][None])
            if summed:
                total += loss.float()
            else:
                per_token[start:stop] = loss.reshape(-1).float()
    return total if summed else per_token.view(labels.shape)


def _needs_grad(head: HeadOutput) -> bool:
    return torch.is_grad_enabled() and (head.hidden.requires_grad or bool(_trainable(head)))


def grads_in_forward(tokens: int, hidden: int, projects: bool) -> bool:
    """Whether the summed loss takes its gradients in forward (keeping the hidden states' [N, H] and the weight's
    fp32 [V, H]) rather than recomputing each tile's logits in backward (one more head matmul, nothing kept): when
    the rows hold at least `hidden` tokens, where the weight's fp32 gradient is no larger than [N, V] fp32 logits;
    always for plain logits (their gradient is what `model.loss_chunk_size` keeps)."""
    return not projects or tokens >= hidden


def tiled_summed_loss(head: HeadOutput, labels: torch.Tensor, tile: int, loss_fn) -> torch.Tensor:
    """`loss_fn(logits, labels)` (summed over tokens) over `tile` tokens at a time: no whole logits, no [N, V]
    gradient (for a `HeadOutput` that projects)."""
    if not _needs_grad(head):
        return _losses(head.hidden, labels, tile, head.project, loss_fn, True)
    if not grads_in_forward(labels.numel(), head.hidden.shape[-1], bool(head.params)):
        return _Recomputed.apply(head.hidden, labels, tile, head.project, loss_fn, True, *head.params)
    return _TiledSummedLoss.apply(head.hidden, labels, tile, head.project, loss_fn, *head.params)


def tiled_token_losses(head: HeadOutput, labels: torch.Tensor, tile: int, token_loss) -> torch.Tensor:
    """Per-token `token_loss(logits, labels)` [*labels.shape], `tile` tokens at a time, forward and backward."""
    if not _needs_grad(head):
        return _losses(head.hidden, labels, tile, head.project, token_loss, False)
    return _Recomputed.apply(head.hidden, labels, tile, head.project, token_loss, False, *head.params)


def chunked_cross_entropy(logits, labels, chunk: int, cross_entropy=summed_cross_entropy) -> torch.Tensor:
    """`cross_entropy(logits, labels)` (summed over tokens) `chunk` tokens at a time: one chunk's fp32 logits and
    softmax at once; what backward keeps is the gradient of the logits, in their dtype."""
    return tiled_summed_loss(as_head(logits), labels, chunk, cross_entropy)


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
        chunk: > 0: compute it `chunk` tokens at a time; 0: all at once (fused: `default_tile` tokens at a time).
        fused: a head's output (`HeadOutput`) is projected and scored tile by tile (`tiled_summed_loss`), never
            whole; off: its logits are made whole first (`model.fused_head_loss=false`).
    """

    __name__ = "CausalLMLoss"

    def __init__(self, cross_entropy=None, chunk: int = 0, fused: bool = True):
        self.cross_entropy = cross_entropy or summed_cross_entropy
        self.chunk, self.fused = chunk, fused
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None  # fp64 [] on the logits' device
        self.tokens: torch.Tensor | None = None  # int64 []

    def totals(self) -> tuple[float, int]:
        if self.loss_sum is None:
            return 0.0, 0
        return float(self.loss_sum), int(self.tokens)

    def __call__(self, logits: torch.Tensor | HeadOutput, labels_and_scale) -> torch.Tensor:
        labels, scale = labels_and_scale  # [B, S] long, [] float
        loss_sum = head_loss(logits, labels, self.chunk, self.fused, self.cross_entropy, tiled_summed_loss)
        counted = (labels != IGNORE_INDEX).sum()
        if self.loss_sum is None:
            self.loss_sum, self.tokens = loss_sum.detach().double(), counted
        else:
            self.loss_sum, self.tokens = self.loss_sum + loss_sum.detach().double(), self.tokens + counted
        return loss_sum * scale.to(loss_sum.device)


def head_loss(logits: torch.Tensor | HeadOutput, labels, chunk: int, fused: bool, loss_fn, tiled):
    """`loss_fn` on the head's output: fused with the head over tiles of `chunk` tokens (0: `default_tile`), or on
    the whole logits (`fused` off, or a plain tensor), `chunk` tokens at a time when `chunk` > 0. `tiled` is
    `tiled_summed_loss` or `tiled_token_losses`."""
    if not isinstance(logits, HeadOutput):
        return tiled(as_head(logits), labels, chunk, loss_fn) if chunk else loss_fn(logits, labels)
    if fused:
        loss = tiled(logits, labels, chunk or default_tile(logits.vocab), loss_fn)
    else:
        whole = logits.logits()
        loss = tiled(as_head(whole), labels, chunk, loss_fn) if chunk else loss_fn(whole, labels)
    if torch.is_grad_enabled():  # training: backward keeps what it needs (evaluation may still ask for logits)
        logits.release()
    return loss
