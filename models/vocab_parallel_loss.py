"""Megatron's vocab-parallel cross-entropy: the loss from logits whose vocabulary is split over the tensor-parallel
ranks ([..., V_local] each, models/tensor_parallel.py's head), with no rank holding [B, S, V] logits. The max, the
sum of exponentials and the target's logit are all-reduced over the TP group; padded vocabulary rows never reach the
loss. `tp` is a `models.tensor_parallel.TensorParallel` (its group and rank)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.loss import IGNORE_INDEX


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits: the max, the sum of exponentials and the target's
    logit are all-reduced; no rank forms the full-vocabulary logits (Megatron's vocab-parallel loss)."""

    @staticmethod
    def forward(ctx, logits, target, tp, start, vocab_size):  # logits [N, V_local] fp32, target [N]
        logits = logits.clone()
        ids = torch.arange(start, start + logits.shape[-1], device=logits.device)
        logits[:, ids >= vocab_size] = float("-inf")  # padded vocabulary rows never reach the loss
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=tp.group)
        logits -= top[:, None]
        local = target - start
        inside = (local >= 0) & (local < logits.shape[-1])
        local = local.clamp(0, logits.shape[-1] - 1)
        picked = logits.gather(1, local[:, None]).squeeze(1).masked_fill(~inside, 0.0)
        dist.all_reduce(picked, group=tp.group)
        exp = logits.exp_()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=tp.group)
        exp /= total[:, None]  # softmax over the whole vocabulary, this rank's columns
        ctx.save_for_backward(exp, local, inside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):  # grad [N]
        softmax, local, inside = ctx.saved_tensors
        out = softmax.clone()
        out[torch.arange(out.shape[0], device=out.device), local] -= inside.to(out.dtype)
        return out * grad[:, None], None, None, None, None


def vocab_parallel_token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp, vocab_size: int) -> torch.Tensor:
    """Per-token cross-entropy [...] (0 where the label is IGNORE_INDEX) from [..., V_local] logit shards."""
    shape = labels.shape
    logits = logits.float().reshape(-1, logits.shape[-1])
    labels = labels.reshape(-1)
    keep = labels != IGNORE_INDEX
    per_token = _VocabParallelCrossEntropy.apply(
        logits, labels.masked_fill(~keep, 0), tp, tp.rank * logits.shape[-1], vocab_size
    )
    return (per_token * keep).view(shape)


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp, vocab_size: int) -> torch.Tensor:
    """Summed cross-entropy over the labels that are not IGNORE_INDEX, from [..., V_local] logit shards."""
    return vocab_parallel_token_cross_entropy(logits, labels, tp, vocab_size).sum()
