"""The last stage's view of the data: each micro-batch with the scale that makes the loss a global mean."""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.context_parallel import ContextParallel, sum_over_context
from models.loss import IGNORE_INDEX


class LossScaledBatches:
    """Attach to every micro-batch of a step the scale that makes the loss a global token mean.

    Reads a step's micro-batches ahead (((input_ids, position_ids), labels, tokens) from
    data/collator.py), counts their target tokens, sums the count over the DP group and yields
    ((input_ids, position_ids), (labels, scale)) with scale = micro_batches * dp / global_target_tokens
    (see `models.loss.CausalLMLoss`). `step_tokens` and `step_input_tokens` are the step's global
    target tokens and tokens that are not padding.
    """

    def __init__(self, batches, micro_batches: int, dp_group, dp_size: int):
        self.batches, self.micro_batches, self.dp_group, self.dp_size = batches, micro_batches, dp_group, dp_size
        self.pending: list = []
        self.step_tokens = self.step_input_tokens = 0

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            step = [next(self.batches) for _ in range(self.micro_batches)]
            counts = torch.tensor([self.counts(labels) + [int(tokens)] for _, labels, tokens in step]).sum(0)
            if self.dp_size > 1:
                dist.all_reduce(counts, group=self.dp_group)
            self.step_tokens, self.step_input_tokens = int(counts[0]), int(counts[-1])
            self.pending = self.attach(step, counts.tolist())
        return self.pending.pop(0)

    def scale(self, count: int) -> torch.Tensor:
        """The factor that turns a micro-batch's sum into its share of the mean over `count` things of the step."""
        return torch.tensor(self.micro_batches * self.dp_size / max(count, 1))

    def counts(self, labels) -> list[int]:
        """What a micro-batch contributes to the step's denominators (first: its target tokens)."""
        return [int((labels != IGNORE_INDEX).sum())]

    def attach(self, step: list, counts: list[int]) -> list:
        scale = self.scale(counts[0])
        return [(inputs, (labels, scale)) for inputs, labels, _ in step]


class PairScaledBatches(LossScaledBatches):
    """`objective=dpo`: micro-batches of pairs (data/pair_dataset.PairCollator) as `models.preference.PreferenceLoss`
    takes them: ((input_ids, position_ids), (labels, reference log-probs, pair scale, token scale)), the pair scale
    over the step's pairs that score (both sequences keep a completion token), the token scale over their chosen
    completion tokens. `step_pairs` counts those pairs over the DP group.

    Under context parallelism (`context`: the stage's place, models/context_parallel.py) each rank holds S/C positions
    of every sequence: whether a pair scores is decided on the whole sequences' target counts (summed over the CP
    group). Each of the C ranks computes the same pair losses (`models.context_parallel.sum_over_context`), so each
    counts the pairs, as a data replica would, and DeepSpeed's average over them (`dp_size` counts them) is the
    mean over the step's pairs."""

    step_pairs = 0

    def __init__(self, batches, micro_batches: int, dp_group, dp_size: int, context: ContextParallel | None = None):
        super().__init__(batches, micro_batches, dp_group, dp_size)
        self.context = context or ContextParallel()

    def counts(self, labels) -> list[int]:
        labels, _ = labels
        tokens = (labels != IGNORE_INDEX).sum(-1)
        shard_tokens = int(tokens.sum())
        tokens = sum_over_context(tokens, self.context)  # whole sequences
        p = labels.shape[0] // 2
        kept = (tokens[:p] > 0) & (tokens[p:] > 0)
        return [shard_tokens, int(kept.sum()), int((tokens[:p] * kept).sum())]

    def attach(self, step: list, counts: list[int]) -> list:
        self.step_pairs = counts[1] // self.context.size
        pair_scale, token_scale = self.scale(counts[1]), self.scale(counts[2])
        return [(inputs, (labels, ref, pair_scale, token_scale)) for inputs, (labels, ref), _ in step]
