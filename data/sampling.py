"""Which rows each data-parallel rank reads, in which order, from any step on.

Training: per epoch, the indices `DistributedSampler(shuffle=True, drop_last=True, seed)` would give the
data-parallel rank, computed as one seeded `torch.randperm` (no sampler object; every rank gets the same
count), and a step count derived from the row count alone, so every stage, middle ones included, agrees on
it without touching the data. Resuming at step k skips
exactly the indices that steps 0..k-1 consumed.

Evaluation: every row exactly once whatever the DP size and micro-batch size. Rows are dealt
round-robin to DP ranks and the tail is filled with padding samples (index -1, no targets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Subset


@dataclass(frozen=True)
class TrainPlan:
    num_rows: int
    dp_size: int
    micro_batch_size: int
    grad_accum: int

    @property
    def rows_per_step(self) -> int:
        """Rows one DP rank consumes per optimizer step."""
        return self.micro_batch_size * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return (self.num_rows // self.dp_size) // self.rows_per_step

    def total_steps(self, max_steps: int, epochs: int) -> int:
        return max_steps if max_steps > 0 else self.steps_per_epoch * epochs

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, steps already done in that epoch) before optimizer step `step` (0-based)."""
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{self.num_rows} rows make no full step of {self.rows_per_step} rows x {self.dp_size} DP ranks"
            )
        return divmod(step, self.steps_per_epoch)

    def epoch_indices(self, epoch: int, dp_rank: int, seed: int, skip_steps: int = 0) -> torch.Tensor:
        """This rank's row indices for `epoch`, cut to whole steps, after skipping `skip_steps`.

        Exactly `DistributedSampler(shuffle=True, drop_last=True, seed=seed)` after `set_epoch(epoch)`, kept as
        one int64 tensor (the sampler makes a Python list of every row)."""
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        usable = (self.num_rows // self.dp_size) * self.dp_size
        indices = torch.randperm(self.num_rows, generator=generator)[:usable][dp_rank :: self.dp_size]
        indices = indices[: self.steps_per_epoch * self.rows_per_step]
        return indices[skip_steps * self.rows_per_step :]


def train_batches(dataset, plan: TrainPlan, dp_rank: int, seed: int, start_step: int, collate, num_workers=0):
    """Endless iterator of micro-batches for this DP rank, starting at optimizer step `start_step`."""
    epoch, skip = plan.position(start_step)
    while True:
        indices = plan.epoch_indices(epoch, dp_rank, seed, skip)
        loader = DataLoader(
            Subset(dataset, indices),
            batch_size=plan.micro_batch_size,
            shuffle=False,
            drop_last=True,
            collate_fn=collate,
            num_workers=num_workers,
            # NOTE: without a generator each new iterator draws a seed from the global torch RNG, which
            # would shift dropout masks after a resume (the iterator is created at a different step).
            generator=torch.Generator().manual_seed(seed + epoch),
        )
        yield from loader
        epoch, skip = epoch + 1, 0


def eval_num_batches(num_rows: int, dp_size: int, micro_batch_size: int, micro_batches: int) -> int:
    """`eval_batch` calls needed to see every row once."""
    return max(1, math.ceil(num_rows / (dp_size * micro_batch_size * micro_batches)))


def eval_indices(num_rows: int, dp_size: int, dp_rank: int, micro_batch_size: int, micro_batches: int) -> torch.Tensor:
    """This rank's eval rows, padded with -1 so all ranks run the same number of micro-batches."""
    total = eval_num_batches(num_rows, dp_size, micro_batch_size, micro_batches) * dp_size
    total *= micro_batch_size * micro_batches
    everything = torch.full((total,), -1, dtype=torch.long)
    everything[:num_rows] = torch.arange(num_rows)
    return everything[dp_rank::dp_size]


def eval_batches(dataset, indices: list[int], micro_batch_size: int, collate):
    loader = DataLoader(
        Subset(dataset, indices),
        batch_size=micro_batch_size,
        shuffle=False,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(0),  # leaves the global RNG (dropout) untouched
    )
    return iter(loader)
