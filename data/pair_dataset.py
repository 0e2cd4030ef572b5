"""Preference pairs over tokenized stores (data/store.py built with `pairs=True`): pair i of a store is its rows
2i (prompt + chosen) and 2i + 1 (prompt + rejected), each cut to `seq_length` from its start (TRL's
`keep_start`), tokenized as data/pairs.py says. As `TokenizedDataset`, files are concatenated or mixed by
weights (by pair), no pair is dropped (a pair without targets, a prompt that fills `seq_length`, scores
nothing and is counted in the report), and every per-pair quantity is an array.

`PairCollator` lays a micro-batch of P pairs out as the pipeline takes it: 2P sequences, the P chosen first and
the P rejected after (TRL's order), as `CausalLMCollator` lays out rows (labels shifted once, there).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from data.collator import CausalLMCollator
from data.dataset import StoreDataset
from data.errors import DataError
from data.pairs import SEQUENCES_PER_PAIR
from schema.data import DataConfig


class PairDataset(StoreDataset):
    """Preference pairs of one or more data files (arguments as `data.dataset.TokenizedDataset`'s).
    Item: (chosen ids, chosen targets, rejected ids, rejected targets, reference log-probs [2] (chosen, rejected));
    index -1 is a padding pair. `reference` ([store pairs, 2] in the stores' own order, whatever the mixture:
    training/reference_logps.py) is None until the reference pass has run (zeros then, as for the reference-free
    SimPO)."""

    ITEM_ROWS = SEQUENCES_PER_PAIR  # rows 2i (prompt + chosen) and 2i + 1 (prompt + rejected)
    FINGERPRINT_SALT = b"pairs\n"
    reference: np.ndarray | None = None

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
        build: bool = True,
        beat=None,
        log=None,
    ):
        super().__init__(
            path,
            tokenizer,
            cfg,
            truncate=seq_length,
            pairs=True,
            weights=weights,
            seed=seed,
            cache_dir=cache_dir,
            workers=workers,
            build=build,
            beat=beat,
            log=log,
        )
        self.seq_length = seq_length
        if len(self) and not self.has_targets().any():
            raise DataError(
                f"{path}: none of the {len(self)} pairs has a completion token within "
                f"seq_length={seq_length} (prompts that fill seq_length)"
            )

    @property
    def store_pairs(self) -> int:
        """Pairs in the stores, each once (the mixture may repeat or skip some)."""
        return self.store_items

    def store_order(self) -> PairDataset:
        """This dataset without its mixture: item i is the stores' pair i (what the reference pass scores)."""
        view = copy.copy(self)
        view.index = None
        return view

    def pair_id(self, index: int) -> int:
        """The stores' pair behind dataset item `index`."""
        return self.item_id(index)

    def __getitem__(self, index: int):
        index = int(index)
        if index == -1:
            empty = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool)
            return (*empty, *empty, torch.zeros(2))
        store, pair = self._locate(index)
        out = []
        for row in (2 * pair, 2 * pair + 1):
            ids, targets = store.span(row)
            out += [torch.from_numpy(ids), torch.from_numpy(targets)]
        ref = (
            torch.zeros(2)
            if self.reference is None
            else torch.from_numpy(np.array(self.reference[self.pair_id(index)]))
        )
        return (*out, ref)

    def pair_array(self, name: str) -> np.ndarray:
        """A per-row array of the stores as [pairs, 2] (chosen, rejected) in dataset order (`item_array`)."""
        return self.item_array(name)

    def has_targets(self) -> np.ndarray:
        """bool [pairs]: both sequences keep a completion token (what TRL keeps)."""
        return (self.pair_array("row_targets") > 0).all(axis=1)

    def report(self) -> dict:
        lengths, targets = self.pair_array("lengths"), self.pair_array("row_targets")
        tokens = int(lengths.sum(dtype=np.int64))
        return {
            "file": self.path,
            "pairs": len(self),
            "tokens": tokens,
            "target_tokens": int(targets.sum(dtype=np.int64)),
            "truncated_pairs": int((self.pair_array("full_lengths") > lengths).any(axis=1).sum()),
            "pairs_without_targets": int((~self.has_targets()).sum()),
            "no_target_examples": self.no_target_examples[:5],
            "formats": self.formats,
        }


class PairCollator(CausalLMCollator):
    """P pairs -> ((input_ids [2P, S], position_ids [2P, S]), (labels [2P, S], reference log-probs [2P]), tokens),
    as `CausalLMCollator` lays out rows: the chosen sequences in rows 0..P-1, the rejected in P..2P-1 (TRL's
    order). `context`: (this rank's index, C) of its context-parallel group: each rank keeps its S/C positions of
    every sequence (the loss sums a sequence's log-probs over the group: models/preference.py)."""

    def __init__(self, seq_length: int, pad_token_id: int, lengths: bool = False, context: tuple[int, int] = (0, 1)):
        super().__init__(seq_length, pad_token_id, lengths=lengths, context=context)

    def __call__(self, samples: list):
        inputs, labels, tokens = super().__call__([(s[0], s[1]) for s in samples] + [(s[2], s[3]) for s in samples])
        ref = torch.stack([s[4] for s in samples]).to(torch.float32)  # [P, 2]
        return inputs, (labels, torch.cat([ref[:, 0], ref[:, 1]])), tokens
