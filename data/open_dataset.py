"""The dataset a run reads from one `train_file` or `eval_file`: the one place that decides it, for the trainer
(training/data_setup.py) and `python -m data.prepare` alike, so both build and find the same stores."""

from __future__ import annotations

import logging

from data.dataset import TokenizedDataset
from data.pair_dataset import PairDataset
from schema.train import TrainConfig

log = logging.getLogger("trainer")


def open_dataset(
    cfg: TrainConfig, spec, tokenizer, *, train: bool, cache_dir: str, build: bool = True, beat=None, log=log.info
) -> TokenizedDataset | PairDataset:
    """The dataset `cfg.objective` reads from `spec` (train_file or eval_file): pairs for dpo, rows for sft;
    a train set is mixed by data.train_weights and seed."""
    d = cfg.data
    kw = dict(cache_dir=cache_dir, workers=d.tokenize_workers, build=build, beat=beat, log=log)
    if train:
        kw.update(weights=d.train_weights, seed=cfg.seed)
    if cfg.objective == "dpo":  # pairs are never concatenated (validate refuses it)
        return PairDataset(spec, tokenizer, cfg.seq_length, d, **kw)
    return TokenizedDataset(spec, tokenizer, cfg.seq_length, d, concat=d.concatenate, **kw)
