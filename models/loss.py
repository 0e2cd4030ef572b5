"""The training loss: fp32 cross-entropy summed over target tokens, scaled to a global token mean.

Model code only: no DeepSpeed import, so data code and tests can use `IGNORE_INDEX` and the loss alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class CausalLMLoss:
    """fp32 cross-entropy summed over scored tokens, times a per-step scale.

    Labels arrive already shifted (labels[t] is the target of position t; see `data.collator`),
    together with `scale` = (micro-batches x DP size) / (target tokens in the whole global
    batch). DeepSpeed divides each micro-batch loss by the micro-batch count and averages
    gradients over DP ranks, so the optimizer sees the gradient of the mean loss over every
    target token of the step, however tokens fall across micro-batches. A micro-batch with no
    target token adds exactly 0.

    `totals()` returns the (summed loss, token count) seen since the last `reset()`: the exact
    token-weighted figures for metrics and evaluation.
    """

    __name__ = "CausalLMLoss"

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.loss_sum = 0.0
        self.tokens = 0

    def totals(self) -> tuple[float, int]:
        return self.loss_sum, self.tokens

    def __call__(self, logits: torch.Tensor, labels_and_scale) -> torch.Tensor:
        labels, scale = labels_and_scale  # [B, S] long, [] float
        loss_sum = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.loss_sum += float(loss_sum.detach())
        self.tokens += int((labels != IGNORE_INDEX).sum())
        return loss_sum * scale.to(loss_sum.device)
