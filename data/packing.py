"""Sequence packing: several rows share one `seq_length` row, on arrays of row lengths.

- `data.packing=true` (`PackedDataset`): rows are placed by best-fit decreasing (longest first, each into
  the fullest packed row it still fits; ties by row index), a pure function of the row lengths: every rank
  of every DP group that loads the same tokenized rows builds the same packed rows, and a resume rebuilds
  them exactly. The sampler then shuffles packed rows per epoch as it shuffles plain rows.
- `data.concatenate=true` (`BlockDataset`, pretraining-style): documents (each ended with EOS) are laid end
  to end in dataset order and the stream is cut into `seq_length` blocks, with no padding at all (the last
  partial block is dropped in training, padded in evaluation). A document cut by a block edge continues in
  the next block as a piece of its own.

Either way an item is a list of (ids, targets) pieces. The collator (data/collator.py) restarts
`position_ids` at 0 for each piece and never lets a label cross from one piece into the next; the decoder
layers rebuild per-piece attention from those `position_ids` (models/layers.py).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np
from torch.utils.data import Dataset


def pack_rows(lengths: Sequence[int] | np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing. Returns (order, starts): packed row b holds rows order[starts[b]:starts[b + 1]],
    in the order they were placed. Rows longer than `capacity` are an error.

    The free room of every open packed row is kept per amount (a heap of packed-row indices for each
    amount, and the sorted list of amounts that have one), so each placement costs O(log capacity).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and lengths.max() > capacity:
        index = int(np.argmax(lengths > capacity))
        raise ValueError(f"row {index} has {lengths[index]} tokens, more than seq_length={capacity}")
    sorted_rows = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties by row index
    placed = np.empty(len(lengths), dtype=np.int64)  # packed row of the i-th placement
    heaps: dict[int, list[int]] = {}  # free room -> heap of packed-row indices with exactly that room
    rooms: list[int] = []  # sorted free-room amounts that have a packed row
    opened = 0
    for i, n in _in_slices(lengths[sorted_rows]):
        at = bisect.bisect_left(rooms, n)
        if at < len(rooms):
            room = rooms[at]
            b = heapq.heappop(heaps[room])
            if not heaps[room]:
                del heaps[room]
                rooms.pop(at)
        else:
            room, b, opened = capacity, opened, opened + 1
        placed[i] = b
        if room - n > 0:
            left = room - n
            if left not in heaps:
                heaps[left] = []
                bisect.insort(rooms, left)
            heapq.heappush(heaps[left], b)
    by_row = np.argsort(placed, kind="stable")  # placement order kept inside each packed row
    starts = np.concatenate([[0], np.cumsum(np.bincount(placed, minlength=opened))]).astype(np.int64)
    return sorted_rows[by_row].astype(np.int64), starts


def _in_slices(values: np.ndarray, size: int = 65536):
    """(index, value) of an array as Python ints, converted a slice at a time (no list of every row)."""
    for start in range(0, len(values), size):
        yield from enumerate(values[start : start + size].tolist(), start)


class PackedDataset(Dataset):
    """A tokenized dataset seen as packed rows: item b is the list of (ids, targets) rows packed into it."""

    def __init__(self, dataset, seq_length: int):
        self.dataset, self.seq_length = dataset, seq_length
        self.order, self.starts = pack_rows(dataset.lengths(), seq_length)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def bin(self, index: int) -> list[int]:
        return self.order[self.starts[index] : self.starts[index + 1]].tolist()

    def __getitem__(self, index: int) -> list:
        index = int(index)  # samplers hand over 0-d tensors
        if index == -1:  # an evaluation filler (data/sampling.py): no rows
            return []
        return [self.dataset[i] for i in self.bin(index)]

    def fingerprint(self) -> str:
        return self.dataset.fingerprint()  # packing is a function of the rows alone

    def report(self) -> dict:
        """The dataset's report plus what packing bought: rows per packed row, padding before and after."""
        report = self.dataset.report()
        tokens, rows, packed = report["tokens"], len(self.dataset), len(self)
        report.update(
            packed_rows=packed,
            rows_per_packed_row=rows / max(packed, 1),
            padding_share_unpacked=1 - tokens / max(rows * self.seq_length, 1),
            padding_share_packed=1 - tokens / max(packed * self.seq_length, 1),
        )
        return report

    def __getattr__(self, name: str):  # from_cache, store_dirs, no_target_examples, target_tokens ...
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


class BlockDataset(Dataset):
    """Documents end to end, cut into `seq_length` blocks (data.concatenate). Item b is the list of (ids, targets)
    pieces of the documents that block b covers. `drop_last`: training drops the last partial block (no padding
    anywhere); evaluation keeps it (padded by the collator) so every token is scored."""

    def __init__(self, dataset, seq_length: int, drop_last: bool = True):
        self.dataset, self.seq_length = dataset, seq_length
        self.ends = np.cumsum(dataset.lengths(), dtype=np.int64)  # document i is stream [ends[i-1], ends[i])
        total = int(self.ends[-1]) if len(self.ends) else 0
        self.total_tokens = total
        self.num_blocks = total // seq_length if drop_last else -(-total // seq_length)

    def __len__(self) -> int:
        return self.num_blocks

    def pieces(self, index: int) -> list[tuple[int, int, int]]:
        """(document, start, end) token ranges, within each document, that block `index` holds."""
        lo = index * self.seq_length
        hi = min(lo + self.seq_length, self.total_tokens)
        out = []
        doc = int(np.searchsorted(self.ends, lo, side="right"))
        while doc < len(self.ends) and lo < hi:
            begin = int(self.ends[doc - 1]) if doc else 0
            end = min(hi, int(self.ends[doc]))
            out.append((doc, lo - begin, end - begin))
            lo, doc = end, doc + 1
        return out

    def __getitem__(self, index: int) -> list:
        index = int(index)
        if index == -1:
            return []
        return [self.dataset.span(doc, start, end) for doc, start, end in self.pieces(index)]

    def fingerprint(self) -> str:
        return self.dataset.fingerprint()

    def report(self) -> dict:
        """The documents' report plus the blocks: how many, and the tokens of the dropped partial block."""
        report = self.dataset.report()
        kept = self.num_blocks * self.seq_length
        report.update(
            blocks=self.num_blocks,
            tokens_in_blocks=min(kept, self.total_tokens),
            tokens_dropped=max(self.total_tokens - kept, 0),
            padding_share_packed=max(kept - self.total_tokens, 0) / max(kept, 1),
        )
        return report

    def __getattr__(self, name: str):
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def arranged(dataset, packing: bool, concatenate: bool, seq_length: int, train: bool):
    """The dataset as training or evaluation reads it: rows, packed rows, or blocks of concatenated documents."""
    if concatenate:
        return BlockDataset(dataset, seq_length, drop_last=train)
    if packing:
        return PackedDataset(dataset, seq_length)
    return dataset
