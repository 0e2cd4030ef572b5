"""The last stage's view of the data: each micro-batch with the scale that makes the loss a global token mean."""

from __future__ import annotations

import torch
import torch.distributed as dist

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
            counts = torch.tensor(
                [sum(int((labels != IGNORE_INDEX).sum()) for _, labels, _ in step), sum(int(n) for *_, n in step)],
                dtype=torch.long,
            )
            if self.dp_size > 1:
                dist.all_reduce(counts, group=self.dp_group)
            self.step_tokens, self.step_input_tokens = int(counts[0]), int(counts[1])
            scale = torch.tensor(self.micro_batches * self.dp_size / max(self.step_tokens, 1))
            self.pending = [(inputs, (labels, scale)) for inputs, labels, _ in step]
        return self.pending.pop(0)
