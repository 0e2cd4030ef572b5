"""Sequence packing (`data.packing=true`): several tokenized rows share one `seq_length` row.

Rows are placed by best-fit decreasing (longest first, each into the fullest packed row it still
fits; ties by row index), a pure function of the row lengths: every rank of every DP group that
loads the same tokenized rows builds the same packed rows, and a resume rebuilds them exactly. The
sampler then shuffles packed rows per epoch as it shuffles plain rows.

The collator (data/collator.py) restarts `position_ids` at 0 for each row of a packed row and never
lets a label cross from one row into the next; the decoder layers rebuild per-row attention from
those `position_ids` (models/layers.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from torch.utils.data import Dataset


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Row indices grouped into packed rows of at most `capacity` tokens (best-fit decreasing).

    Each packed row lists its rows in the order they were placed; rows longer than `capacity` are
    an error (the dataset truncates rows to seq_length before this).
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, bin index), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        if n > capacity:
            raise ValueError(f"row {index} has {n} tokens, more than seq_length={capacity}")
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, b = free.pop(at)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(index)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return bins


class PackedDataset(Dataset):
    """A tokenized dataset seen as packed rows: item i is the list of (ids, targets) rows packed into it."""

    def __init__(self, dataset, seq_length: int):
        self.dataset, self.seq_length = dataset, seq_length
        self.bins = pack_rows([len(dataset[i][0]) for i in range(len(dataset))], seq_length)

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, index: int) -> list:
        if index == -1:  # an evaluation filler (data/sampling.py): no rows
            return []
        return [self.dataset[i] for i in self.bins[index]]

    def fingerprint(self) -> str:
        return self.dataset.fingerprint()  # packing is a function of the rows alone

    def report(self) -> dict:
        """The dataset's report plus what packing bought: rows per packed row, padding before and after."""
        report = self.dataset.report()
        tokens, rows = report["tokens"], len(self.dataset)
        report.update(
            packed_rows=len(self.bins),
            rows_per_packed_row=rows / max(len(self.bins), 1),
            padding_share_unpacked=1 - tokens / max(rows * self.seq_length, 1),
            padding_share_packed=1 - tokens / max(len(self.bins) * self.seq_length, 1),
        )
        return report

    def __getattr__(self, name: str):  # cache_file, from_cache, no_target_lines, target_tokens ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)
