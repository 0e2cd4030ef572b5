"""The LM head of the last stage: its output is the logits not yet made (`models.loss.HeadOutput`), which the loss
makes tile by tile with itself, or whole for whoever asks for logits (`split_stats`). The untied head is a module with
HF's `lm_head.weight`; a tied head is the embedding's module run with `tied_lm_head_forward` (DeepSpeed's
`TiedLayerSpec`); tensor parallelism's heads (models/tensor_parallel.py) are the same with this rank's vocabulary rows.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.loss import HeadOutput


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """transformers' final-logit soft-capping, `cap * tanh(logits / cap)` in its order of operations (None: none)."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def set_logit_rules(head, config) -> None:
    """What a head of `config` does to its logits, as transformers does: divided by the family's `logits_divisor`
    field (Granite's `logits_scaling`) or times its `logits_multiplier` (Cohere's `logit_scale`), then soft-capped at
    `final_logit_softcapping` (Gemma's). None: not."""
    from models.families import family_of

    family = family_of(config)
    head.logit_divisor = getattr(config, family.logits_divisor) if family.logits_divisor else None
    head.logit_multiplier = getattr(config, family.logits_multiplier) if family.logits_multiplier else None
    head.logit_cap = getattr(config, "final_logit_softcapping", None)


def final_logits(logits: torch.Tensor, head) -> torch.Tensor:
    """`logits` ([..., V]) after `head`'s rules (`set_logit_rules`)."""
    if head.logit_divisor is not None:
        logits = logits / head.logit_divisor
    if head.logit_multiplier is not None:
        logits = logits * head.logit_multiplier
    return softcap(logits, head.logit_cap)


class LMHeadPipe(nn.Linear):
    """Output projection. Keys: `weight` = HF `lm_head.weight`. Soft-caps the logits where the config says. Returns
    the logits not yet made (`models.loss.HeadOutput`): the loss makes them tile by tile."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)
        set_logit_rules(self, config)

    def forward(self, hidden: torch.Tensor | tuple) -> HeadOutput | tuple:
        return head_output(hidden, self)


def with_stats(inputs: torch.Tensor | tuple, head) -> torch.Tensor | tuple:
    """`head(hidden)`, and the router statistics passed on beside the logits when a model has experts."""
    if isinstance(inputs, tuple):
        hidden, stats = inputs
        return head(hidden), stats
    return head(inputs)


def split_stats(outputs: HeadOutput | tuple, lazy: bool = False) -> tuple:
    """(logits, router statistics or None) of the last stage's output; the whole logits unless `lazy`."""
    logits, stats = outputs if isinstance(outputs, tuple) else (outputs, None)
    return (logits.logits() if isinstance(logits, HeadOutput) and not lazy else logits), stats


def tied_lm_head_forward(embedding: nn.Module, hidden: torch.Tensor | tuple) -> HeadOutput | tuple:
    """LM head that reuses the (tied) input embedding's weight: `TiedLayerSpec.forward_fn`."""
    return head_output(hidden, embedding)


def head_output(inputs: torch.Tensor | tuple, head: nn.Module, enter=None) -> HeadOutput | tuple:
    """The `HeadOutput` of `head` (its `weight` as output rows, its logit rules applied: `final_logits`) on the norm's
    output, which `enter` prepares first (tensor parallelism gathers the sequence), and the router statistics beside."""

    def logits(hidden):  # [..., H] -> [..., V]
        return final_logits(F.linear(hidden, head.weight), head)

    def make(hidden):
        return HeadOutput(enter(hidden) if enter else hidden, logits, head.weight.shape[0], (head.weight,))

    return with_stats(inputs, make)
