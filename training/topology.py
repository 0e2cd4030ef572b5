"""Where a rank sits in the PP x DP grid, and the numbers that follow from it (the one place for them).

DeepSpeed's `PipeModelDataParallelTopology` orders ranks pipe-major: rank = stage * DP + dp_rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    """Where this rank sits: PP x DP with pipe as the outer axis (rank = stage * dp + dp_rank)."""

    rank: int
    world: int
    num_stages: int

    @property
    def dp(self) -> int:
        return max(1, self.world // self.num_stages)  # >= 1 so logging works before the layout is validated

    @property
    def stage(self) -> int:
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def has_data(self) -> bool:
        return self.is_first or self.is_last

    @property
    def reporting(self) -> bool:
        """The one rank that writes metrics and results: last stage, DP rank 0 (it has the loss)."""
        return self.is_last and self.dp_rank == 0

    def global_batch(self, micro_batch_size: int, gradient_accumulation_steps: int) -> int:
        """Sequences per optimizer step over all DP ranks."""
        return micro_batch_size * gradient_accumulation_steps * self.dp
