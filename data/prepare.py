"""Tokenize a run's data ahead of training, on any machine (no GPU, no process group):

    python -m data.prepare <the trainer's overrides>
    python -m data.prepare experiment=llama2_7b_8gpu train_file=corpus/ output_dir=/runs/7b data.tokenize_workers=16

Builds the tokenized stores (data/store.py) exactly where and as `trainer.py` with the same overrides would
(`data.cache_dir`, default `output_dir/data_cache`; the same key: files, tokenizer, data settings, seq_length),
so the launch then finds them and starts at once. Megatron's `preprocess_data.py` and axolotl's `preprocess`
do the same job. Run it again after changing the data: only what changed is tokenized.

NOTE: an entry point like trainer.py (it composes the trainer's config), so it may import `training`.
"""

from __future__ import annotations

import sys

from data.dataset import TokenizedDataset, cache_root
from data.errors import DataError


def main(argv: list[str] | None = None) -> int:
    from models.tokenizer import load_tokenizer
    from training.cli import compose_config
    from training.config import evaluating, validate

    overrides = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("-h", "--help")]
    if argv is None and len(overrides) != len(sys.argv) - 1:
        print(__doc__)
        return 0
    try:
        cfg = compose_config(overrides)
        validate(cfg)
        d = cfg.data
        if d.cache_dir == "":
            raise ValueError("data.cache_dir='' keeps tokenized data only for one run: nothing to prepare")
        cache, _ = cache_root(d.cache_dir, cfg.output_dir)
        path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
        if path is None:
            raise ValueError("tokenizer_name_or_path (or model_name_or_path) is not set")
        setting = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
        tokenizer = load_tokenizer(path, setting)
        files = [cfg.train_file] if cfg.do_train else []
        files += [cfg.eval_file] if evaluating(cfg) else []
        if not files or None in files:
            raise ValueError("train_file (or eval_file) is not set: nothing to prepare")
        for spec in files:
            ds = TokenizedDataset(spec, tokenizer, cfg.seq_length, d, cache_dir=cache, workers=d.tokenize_workers,
                                  concat=d.concatenate, log=lambda line: print(line, flush=True))  # fmt: skip
            how = "found" if ds.from_cache else "built"
            report = ds.report()
            print(f"{spec}: {report['rows']:,} rows, {report['tokens']:,} tokens, store {how}: "
                  f"{', '.join(ds.store_dirs)}", flush=True)  # fmt: skip
    except (DataError, ValueError) as e:
        print(f"data.prepare: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
