"""Where a rank sits in the PP x DP x CP x TP grid, and the numbers that follow from it (the one place for them).

DeepSpeed's `PipeModelDataParallelTopology` orders ranks pipe-major, then data, then model (tensor-parallel).
Context parallelism lives inside DeepSpeed's data axis (DP x C of them; DeepSpeed averages gradients over all,
and the loss scale counts them: training/batches.py): its index is dp_rank * C + cp_rank, so
rank = stage * (DP * C * TP) + (dp_rank * C + cp_rank) * TP + tp_rank: the ranks of a TP group are adjacent (one
node), and a CP group's C x T ranks too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coords:
    """This rank's place: pipeline stage, data-parallel replica, context-parallel and tensor-parallel rank."""

    rank: int
    world: int
    num_stages: int
    tp: int = 1  # tensor-parallel ranks per stage and replica
    loss_on_first: bool = False  # DualPipeV: rank 0 holds the first and the last stage, so it loads and scores
    cp: int = 1  # context-parallel ranks per stage and replica (each holds S/C positions of the same rows)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: sets of ranks that read different rows."""
        return max(1, self.world // (self.num_stages * self.tp * self.cp))  # >= 1 so logging works before validation

    @property
    def data_ranks(self) -> int:
        """DeepSpeed's data-parallel size: DP x C (gradients are averaged over them)."""
        return self.dp * self.cp

    @property
    def data_index(self) -> int:
        """This rank's index on DeepSpeed's data axis: dp_rank * C + cp_rank."""
        return (self.rank // self.tp) % self.data_ranks

    @property
    def stage(self) -> int:
        return self.rank // (self.data_ranks * self.tp)

    @property
    def dp_rank(self) -> int:
        return self.data_index // self.cp

    @property
    def cp_rank(self) -> int:
        return self.data_index % self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        """The stage that computes the loss: the last pipeline rank, or rank 0 under DualPipeV."""
        return self.stage == (0 if self.loss_on_first else self.num_stages - 1)

    @property
    def has_data(self) -> bool:
        """First and last stage: every TP rank of them reads the same (DP-indexed) batches."""
        return self.is_first or self.is_last

    @property
    def reporting(self) -> bool:
        """The one rank that writes metrics and results: last stage, DP, CP and TP rank 0 (it has the loss)."""
        return self.is_last and self.data_index == 0 and self.tp_rank == 0

    def global_batch(self, micro_batch_size: int, gradient_accumulation_steps: int) -> int:
        """Sequences per optimizer step over all DP ranks."""
        return micro_batch_size * gradient_accumulation_steps * self.dp
