"""Datasets over tokenized stores (data/store.py): one row, one sequence; nothing per row lives in Python.

A `TokenizedDataset` is a view of one store per data file (`StoreDataset`, which PairDataset shares): the
files concatenated, or mixed by weights (an index array, data/sources.py), rows truncated to `seq_length`
(data.concatenate keeps documents whole for `data/packing.BlockDataset`). No row is ever dropped: a row with
no target token left after truncation still counts as a sample and contributes nothing to the loss, so every
rank agrees on the row count.
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

from data.errors import DataError
from data.sources import mixture_index, paths_of
from data.store import Store
from data.store_builder import open_or_build
from schema.data import DataConfig


class StoreDataset(Dataset):
    """Items over tokenized stores, one store per data file: the files concatenated, or mixed by weights (an
    index array over items, data/sources.py). An item is `ITEM_ROWS` consecutive rows of its store (a row, or a
    pair's two sequences). What `TokenizedDataset` and `data.pair_dataset.PairDataset` share: opening or
    building the stores, the mixture, locating an item, per-item arrays, the fingerprint.

    Args:
        path: one data file (JSONL, JSON, Parquet, a directory of shards, a datasets directory) or a list.
        tokenizer: the run's tokenizer.
        cfg: the data settings.
        truncate: rows are cut to this many tokens (None: kept whole).
        concat: documents kept whole and ended with EOS, for data.concatenate.
        pairs: the files hold preference pairs (each stored as two rows).
        weights, seed: mix the files by these weights, per item (data/sources.py).
        cache_dir: where stores live; None: a temporary directory kept as long as the dataset.
        workers: tokenize in this many processes (0/1: in this one).
        build: build missing stores (False: they must exist: ranks that open what rank 0 built).
        beat, log: called while building (a collective heartbeat; progress lines).
    """

    ITEM_ROWS = 1
    FINGERPRINT_SALT = b""

    def __init__(
        self,
        path,
        tokenizer,
        cfg: DataConfig,
        *,
        truncate: int | None,
        concat: bool = False,
        pairs: bool = False,
        weights=None,
        seed: int = 0,
        cache_dir: str | None = None,
        workers: int = 0,
        build: bool = True,
        beat=None,
        log=None,
    ):
        self.path = path
        self._tmp = None
        if cache_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenized-")
            cache_dir = self._tmp.name
        extra = {k: v for k, v in (("beat", beat), ("log", log)) if v is not None}
        opened = [
            open_or_build(p, tokenizer, cfg, truncate, concat, cache_dir, workers, build=build, pairs=pairs, **extra)
            for p in paths_of(path)
        ]
        self.stores: list[Store] = [store for store, _ in opened]
        self.from_cache = not any(built for _, built in opened)
        counts = [s.rows // self.ITEM_ROWS for s in self.stores]
        self.starts = np.cumsum([0] + counts)
        self.index = mixture_index(counts, weights, seed)

    def __len__(self) -> int:
        return int(self.starts[-1]) if self.index is None else len(self.index)

    @property
    def store_items(self) -> int:
        """Items in the stores, each once (the mixture may repeat or skip some)."""
        return int(self.starts[-1])

    @property
    def store_dirs(self) -> list[str]:
        return [os.path.abspath(s.directory) for s in self.stores]

    def item_id(self, index: int) -> int:
        """The stores' item behind dataset item `index` (its place in the files concatenated)."""
        return int(index if self.index is None else self.index[index])

    def _locate(self, index: int) -> tuple[Store, int]:
        """(the store, the item's number within it) of dataset item `index`."""
        item = self.item_id(index)
        s = int(np.searchsorted(self.starts, item, side="right")) - 1
        return self.stores[s], item - int(self.starts[s])

    def item_array(self, name: str) -> np.ndarray:
        """A per-row array of the stores (`lengths`, `full_lengths`, `row_targets`, ...) in dataset order:
        [items], or [items, ITEM_ROWS] when an item holds several rows."""
        rows = [np.asarray(getattr(s, name)) for s in self.stores]
        whole = np.concatenate([r if self.ITEM_ROWS == 1 else r.reshape(-1, self.ITEM_ROWS) for r in rows])
        return whole if self.index is None else whole[self.index]

    @property
    def no_target_examples(self) -> list[str]:
        return [w for s in self.stores for w in s.meta["no_target_examples"]]

    @property
    def formats(self) -> dict[str, str]:
        """data file -> the format its rows were read as (native, alpaca, sharegpt: data/formats.py)."""
        return {s.meta["key"]["source"]: s.meta.get("format", "native") for s in self.stores}

    def fingerprint(self) -> str:
        """What training reads, whatever files, tokenizer and settings produced it: the stores' content hashes
        (computed once, when each store was built), in order. A resume compares it (training/checkpointing.py);
        the mixture and the data order follow from the seed and weights, which a resume compares too."""
        digest = hashlib.sha256(self.FINGERPRINT_SALT)
        for store in self.stores:
            digest.update(f"{store.rows}:{store.fingerprint}\n".encode())
        return digest.hexdigest()


class TokenizedDataset(StoreDataset):
    """Rows of one or more data files (`StoreDataset`), truncated to `seq_length` (not with `concat`).
    Index -1 is a padding sample (no tokens, no targets)."""

    def __init__(
        self,
        path,
        tokenizer,
        seq_length: int,
        cfg: DataConfig,
        weights=None,
        seed: int = 0,
        cache_dir: str | None = None,
        workers: int = 0,
        concat: bool = False,
        build: bool = True,
        beat=None,
        log=None,
    ):
        super().__init__(
            path,
            tokenizer,
            cfg,
            truncate=None if concat else seq_length,
            concat=concat,
            weights=weights,
            seed=seed,
            cache_dir=cache_dir,
            workers=workers,
            build=build,
            beat=beat,
            log=log,
        )
        self.seq_length, self.concat = seq_length, concat
        if len(self) and not any(np.asarray(s.row_targets).any() for s in self.stores):
            raise DataError(
                f"{path}: none of the {len(self)} rows has a target token within seq_length={seq_length} "
                "(prompts that fill seq_length, or empty responses)"
            )

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
        """A per-row array of the stores in dataset order (`item_array`)."""
        return self.item_array(name)

    def lengths(self) -> np.ndarray:
        return self.row_array("lengths")

    def target_tokens(self) -> int:
        return int(self.row_array("row_targets").sum(dtype=np.int64))

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
            "formats": self.formats,
        }


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
