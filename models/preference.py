"""Preference losses on per-sequence log-probabilities: DPO (`sigmoid`), IPO (`ipo`) and the reference-free SimPO
(`simpo`), with TRL's formulas and metric names (trl 1.16: `DPOTrainer._compute_loss` for sigmoid and ipo,
`trl.experimental.cpo.CPOTrainer.cpo_loss` for simpo).

Model code only: no DeepSpeed import. A pair's chosen and rejected sequences are scored by the same model; what
enters here is, per sequence, the summed log-probability of its completion tokens and their count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "simpo")


@dataclass(frozen=True)
class PreferenceSettings:
    """beta: the KL strength (DPO), the regularisation tau (IPO), the reward scale (SimPO).
    gamma: SimPO's target margin (TRL's `simpo_gamma`). sft_weight: adds the chosen completions' mean NLL (TRL's
    `loss_type=["sigmoid", "sft"]` with `loss_weights=[1, sft_weight]`)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5
    sft_weight: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.loss_type != "simpo"


def preference_losses(
    settings: PreferenceSettings,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen rewards, rejected rewards), each [P], from summed completion log-probs [P] and the
    completions' token counts [P]. The rewards are detached (metrics)."""
    beta = settings.beta
    chosen_len, rejected_len = (
        chosen_tokens.clamp(min=1).to(chosen_logps.dtype),
        rejected_tokens.clamp(min=1).to(rejected_logps.dtype),
    )
    if settings.loss_type == "simpo":  # length-normalised, reference-free
        chosen_avg, rejected_avg = chosen_logps / chosen_len, rejected_logps / rejected_len
        losses = -F.logsigmoid(beta * (chosen_avg - rejected_avg - settings.gamma / beta))
        return losses, beta * chosen_avg.detach(), beta * rejected_avg.detach()
    chosen_ratio, rejected_ratio = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
    if settings.loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (chosen_ratio - rejected_ratio))
    elif settings.loss_type == "ipo":  # TRL normalises by the completion lengths
        losses = (chosen_ratio / chosen_len - rejected_ratio / rejected_len - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"dpo.loss_type={settings.loss_type}: choose one of {', '.join(LOSS_TYPES)}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def sft_loss(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """The chosen completions' NLL per token, over every chosen token of the batch (TRL's `sft` loss term)."""
    return -chosen_logps.sum() / chosen_tokens.sum().clamp(min=1)


REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def reward_sums(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """[4] sums over pairs of REWARD_METRICS (divide by the pair count for TRL's means)."""
    return torch.stack(
        [
            chosen_rewards.sum(),
            rejected_rewards.sum(),
            (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).sum(),
            (chosen_rewards - rejected_rewards).sum(),
        ]
    )
