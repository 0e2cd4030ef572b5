"""Datasets over tokenized stores (data/store.py): one row, one sequence; nothing per row lives in Python.

A `TokenizedDataset` is a view of one store per data file: the files concatenated, or mixed by weights
(an index array, data/sources.py), rows truncated to `seq_length` (data.concatenate keeps documents whole
for `data/packing.BlockDataset`). No row is ever dropped: a row with no target token left after truncation
still counts as a sample and contributes nothing to the loss, so every rank agrees on the row count.
Every per-row quantity (lengths, target counts) is an array, so samplers, packing and the report never
touch the rows themselves.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
import torch
from torch.utils.data import Dataset

from data.config import DataConfig
from data.errors import DataError
from data.sources import mixture_index, paths_of
from data.store import Store
from data.store_builder import open_or_build


class TokenizedDataset(Dataset):
    """Rows of one or more data files, tokenized into stores under `cache_dir` (built there first when missing).
    Index -1 is a padding sample (no tokens, no targets).

    Args:
        path: one data file (JSONL, JSON, Parquet, a directory of shards, a datasets directory) or a list.
        tokenizer: the run's tokenizer.
        seq_length: rows are truncated to it (not with `concat`).
        cfg: the data settings.
        weights, seed: mix the files by these weights (data/sources.py).
        cache_dir: where stores live; None: a temporary directory kept as long as the dataset.
        workers: tokenize in this many processes (0/1: in this one).
        concat: documents kept whole and ended with EOS, for data.concatenate.
        build: build missing stores (False: they must exist: ranks that open what rank 0 built).
        beat, log: called while building (a collective heartbeat; progress lines).
    """

    def __init__(self, path, tokenizer, seq_length: int, cfg: DataConfig, weights=None, seed: int = 0,
                 cache_dir: str | None = None, workers: int = 0, concat: bool = False, build: bool = True,
                 beat=None, log=None):  # fmt: skip
        self.path, self.seq_length, self.concat = path, seq_length, concat
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenized-")
            cache_dir = self._tmp.name
        extra = {k: v for k, v in (("beat", beat), ("log", log)) if v is not None}
        opened = [open_or_build(p, tokenizer, cfg, None if concat else seq_length, concat, cache_dir, workers,
                                build=build, **extra) for p in paths_of(path)]  # fmt: skip
        self.stores: list[Store] = [store for store, _ in opened]
        self.from_cache = not any(built for _, built in opened)
        self.starts = np.cumsum([0] + [s.rows for s in self.stores])
        self.index = mixture_index([s.rows for s in self.stores], weights, seed)
        if len(self) and not any(np.asarray(s.row_targets).any() for s in self.stores):
            raise DataError(
                f"{path}: none of the {len(self)} rows has a target token within seq_length={seq_length} "
                "(prompts that fill seq_length, or empty responses)"
            )

    @property
    def store_dirs(self) -> list[str]:
        return [s.directory for s in self.stores]

    def __len__(self) -> int:
        return int(self.starts[-1]) if self.index is None else len(self.index)

    def _locate(self, index: int) -> tuple[Store, int]:
        row = int(index if self.index is None else self.index[index])
        s = int(np.searchsorted(self.starts, row, side="right")) - 1
        return self.stores[s], row - int(self.starts[s])

    def span(self, index: int, start: int = 0, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n] long, targets [n] bool) of tokens [start, end) of row `index`."""
        store, row = self._locate(index)
        ids, targets = store.span(row, start, end)
        return torch.from_numpy(ids), torch.from_numpy(targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = int(index)  # samplers hand over 0-d tensors
        if index == -1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool)
        return self.span(index)

    def row_array(self, name: str) -> np.ndarray:
        """A per-row array of the stores (`lengths`, `full_lengths`, `row_targets`) in dataset order."""
        whole = np.concatenate([np.asarray(getattr(s, name)) for s in self.stores])
        return whole if self.index is None else whole[self.index]

    def lengths(self) -> np.ndarray:
        return self.row_array("lengths")

    def target_tokens(self) -> int:
        return int(self.row_array("row_targets").sum(dtype=np.int64))

    @property
    def no_target_examples(self) -> list[str]:
        return [w for s in self.stores for w in s.meta["no_target_examples"]]

    def report(self) -> dict:
        """What training will see: rows, tokens after truncation, truncated rows, share of target tokens."""
        lengths, targets = self.lengths(), self.row_array("row_targets")
        tokens, target_tokens = int(lengths.sum(dtype=np.int64)), int(targets.sum(dtype=np.int64))
        return {
            "file": self.path,
            "rows": len(self),
            "tokens": tokens,
            "target_tokens": target_tokens,
            "target_share": target_tokens / tokens if tokens else 0.0,
            "truncated_rows": int((self.row_array("full_lengths") > lengths).sum()),
            "rows_without_targets": int((targets == 0).sum()),
            # characters the tokenizer dropped or replaced by an unknown token (not byte-level, no byte fallback)
            "rows_with_lost_characters": int(self.row_array("lost_characters").sum(dtype=np.int64)),
            "lost_character_examples": [w for s in self.stores for w in s.meta["lost_character_examples"]][:5],
        }

    def fingerprint(self) -> str:
        """What training reads, whatever files, tokenizer and settings produced it: the stores' content hashes
        (computed once, when each store was built), in order. A resume compares it (training/checkpointing.py);
        the mixture and the data order follow from the seed and weights, which a resume compares too."""
        digest = hashlib.sha256()
        for store in self.stores:
            digest.update(f"{store.rows}:{store.fingerprint}\n".encode())
        return digest.hexdigest()


class PlaceholderDataset(Dataset):
    """What middle pipeline stages get: the row count and nothing else. They never read data."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int):
        raise RuntimeError("a middle pipeline stage never reads data")


def cache_root(cache_dir: str | None, output_dir: str) -> tuple[str, bool]:
    """(where the stores of a run live, whether they are removed after the run): `data.cache_dir`, by default
    `output_dir/data_cache`; "" keeps them only for the run, in `output_dir/.data_tmp`."""
    if cache_dir is None:
        return os.path.join(output_dir, "data_cache"), False
    if cache_dir == "":
        return os.path.join(output_dir, ".data_tmp"), True
    return cache_dir, False
