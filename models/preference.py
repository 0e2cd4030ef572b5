"""Preference losses on per-sequence log-probabilities: DPO (`sigmoid`), IPO (`ipo`) and the reference-free SimPO
(`simpo`), with TRL's formulas and metric names (trl 1.16: `DPOTrainer._compute_loss` for sigmoid and ipo,
`trl.experimental.cpo.CPOTrainer.cpo_loss` for simpo).

Model code only: no DeepSpeed import. A pair's chosen and rejected sequences are scored by the same model; what
enters here is, per sequence, the summed log-probability of its completion tokens and their count.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.context_parallel import ContextParallel, sum_over_context
from models.head import split_stats
from models.loss import IGNORE_INDEX, HeadOutput, head_loss, tiled_token_losses
from schema.model import LossType


@dataclass(frozen=True)
class PreferenceSettings:
    """beta: the KL strength (DPO), the regularisation tau (IPO), the reward scale (SimPO).
    gamma: SimPO's target margin (TRL's `simpo_gamma`). sft_weight: adds the chosen completions' mean NLL (TRL's
    `loss_type=["sigmoid", "sft"]` with `loss_weights=[1, sft_weight]`)."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    gamma: float = 0.5
    sft_weight: float = 0.0

    @classmethod
    def of(cls, dpo) -> PreferenceSettings:
        """From the run's `dpo` settings (schema/train.py `DpoConfig`), every field taken by name."""
        return cls(**{f.name: getattr(dpo, f.name) for f in dataclasses.fields(cls)})


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
        raise ValueError(f"dpo.loss_type={settings.loss_type}: choose one of {', '.join(LossType)}")
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


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 per-token cross-entropy [B, S] (0 where the label is IGNORE_INDEX) from [B, S, V] logits."""
    flat = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return flat.view(labels.shape)


def sequence_logps(
    logits: torch.Tensor | HeadOutput,
    labels: torch.Tensor,
    token_ce=token_cross_entropy,
    chunk: int = 0,
    context: ContextParallel | None = None,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob of each sequence's target tokens [N], their count [N]) from [N, S, V] logits (a vocab shard
    with the vocab-parallel `token_ce`), or from the head's output fused with the loss (`models.loss.head_loss`:
    tiles of `chunk` tokens, recomputed in backward); `chunk` > 0 on whole logits: `chunk` tokens at a time, forward
    and backward. Under context parallelism (`context`) `logits` and `labels` hold this rank's positions; both
    results are the whole sequences'."""
    ce = head_loss(logits, labels, chunk, fused, token_ce, tiled_token_losses)
    logps, tokens = -ce.sum(-1), (labels != IGNORE_INDEX).sum(-1)
    if context is not None and context.size > 1:
        logps, tokens = sum_over_context(logps, context), sum_over_context(tokens, context)
    return logps, tokens


class ReferenceScorer:
    """The last stage's "loss" of the reference pass (training/reference_logps.py): labels arrive as (labels [2P, S],
    reference log-probs (unused), pair ids [P]); keeps (pair ids, per-sequence log-probs [2P], chosen first) of each
    micro-batch in `scored` and returns 0. `context`: the stage's context-parallel place (set with the stage:
    training.engine.build_module)."""

    __name__ = "ReferenceScorer"

    def __init__(self, token_ce=None, chunk: int = 0, fused: bool = True):
        self.token_ce, self.chunk, self.fused = token_ce or token_cross_entropy, chunk, fused
        self.context = ContextParallel()
        self.scored: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, logits: torch.Tensor | tuple, labels_and_extras) -> torch.Tensor:
        logits, _ = split_stats(logits, lazy=True)  # a model with experts: the router statistics beside, unused here
        labels, _, pair_ids = labels_and_extras
        with torch.no_grad():
            logps, _ = sequence_logps(logits, labels, self.token_ce, self.chunk, self.context, self.fused)
        self.scored.append((pair_ids.cpu(), logps.float().cpu()))
        return torch.zeros((), device=logits.device)


class PreferenceLoss:
    """The last stage's loss for `objective=dpo`: a micro-batch holds P pairs as 2P sequences, the P chosen first and
    the P rejected after (TRL's order), with labels already shifted (targets: the completion tokens).

    `labels_and_extras` = (labels [2P, S], reference log-probs [2P] (zeros for SimPO), pair scale [], token scale
    []): the scales make DeepSpeed's averaging over micro-batches and DP ranks the mean over every pair of the
    global batch (and, for the chosen-NLL term, over every chosen completion token), as `CausalLMLoss` does for
    tokens. Sums for the metrics (`SUMS`) accumulate as tensors; `totals()` reads them.

    Args:
        settings: the loss type and its constants.
        token_ce: (logits, labels) -> per-token cross-entropy; the vocab-parallel one under TP.
        chunk: > 0: compute it `chunk` tokens at a time, forward and backward.
        fused: the head's output is projected tile by tile with the loss (`models.loss.head_loss`), never whole.

    `context` is the stage's context-parallel place (set with the stage: training.engine.build_module): each rank
    of a CP group then holds every sequence's S/C positions, sums their log-probs over the group and computes the
    same losses and sums (`training.loop` counts one rank's).
    """

    __name__ = "PreferenceLoss"
    # What `sums` holds: the preference loss summed over the pairs that score, their count, the REWARD_METRICS
    # sums, and the chosen completions' summed NLL and token count (the sft term).
    SUMS = ("loss", "pairs", *REWARD_METRICS, "chosen_nll", "chosen_tokens")

    def __init__(self, settings: PreferenceSettings, token_ce=None, chunk: int = 0, fused: bool = True):
        self.settings, self.token_ce, self.chunk, self.fused = settings, token_ce or token_cross_entropy, chunk, fused
        self.context = ContextParallel()
        self.reset()

    def reset(self) -> None:
        self.sums: torch.Tensor | None = None  # fp64 [len(SUMS)]

    def totals(self, sums: torch.Tensor | None = None) -> dict[str, float]:
        """TRL's metrics from `sums` (default: this rank's since `reset()`; pass them summed over ranks for the
        global figures): `loss` (the mean preference loss over the pairs, plus `sft_weight` x the chosen tokens'
        mean NLL) and the reward means, and the pair count."""
        sums = self.sums if sums is None else sums
        if sums is None:
            return {"pairs": 0}
        got = dict(zip(self.SUMS, sums.tolist(), strict=True))
        pairs = max(got["pairs"], 1.0)
        loss = got["loss"] / pairs + self.settings.sft_weight * got["chosen_nll"] / max(got["chosen_tokens"], 1.0)
        return {"loss": loss, "pairs": int(got["pairs"]), **{k: got[k] / pairs for k in REWARD_METRICS}}

    def __call__(self, logits: torch.Tensor | HeadOutput, labels_and_extras) -> torch.Tensor:
        labels, ref_logps, pair_scale, token_scale = labels_and_extras
        logps, tokens = sequence_logps(logits, labels, self.token_ce, self.chunk, self.context, self.fused)
        p = labels.shape[0] // 2
        ref = ref_logps.to(logps.device, logps.dtype)
        losses, chosen_rewards, rejected_rewards = preference_losses(
            self.settings, logps[:p], logps[p:], tokens[:p], tokens[p:], ref[:p], ref[p:]
        )
        kept = (tokens[:p] > 0) & (tokens[p:] > 0)  # padding pairs (no target) add nothing
        losses = losses * kept
        loss = losses.sum() * pair_scale.to(losses.device)
        if self.settings.sft_weight:  # the chosen completions of the pairs that count
            loss = loss - self.settings.sft_weight * (logps[:p] * kept).sum() * token_scale.to(losses.device)
        sft = torch.stack([-(logps[:p].detach() * kept).sum(), (tokens[:p] * kept).sum()])
        sums = torch.cat(
            [
                torch.stack([losses.detach().sum(), kept.sum()]),
                reward_sums(chosen_rewards * kept, rejected_rewards * kept),
                sft,
            ]
        ).double()
        self.sums = sums if self.sums is None else self.sums + sums
        return loss
