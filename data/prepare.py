"""Tokenize a run's data ahead of training, on any machine (no GPU, no process group):

    python -m data.prepare <the trainer's overrides>
    python -m data.prepare experiment=llama2_7b_8gpu train_file=corpus/ output_dir=/runs/7b data.tokenize_workers=16

Builds the tokenized stores (data/store.py) exactly where and as `trainer.py` with the same overrides would
(`data.cache_dir`, default `output_dir/data_cache`; the same key: files, tokenizer, data settings, seq_length),
so the launch then finds them and starts at once. Megatron's `preprocess_data.py` and axolotl's `preprocess`
do the same job. Run it again after changing the data: only what changed is tokenized.

Every objective and data format prepares: the dataset is opened by the trainer's own `open_dataset`.
"""

from __future__ import annotations

import sys

from common.hub import HubError, resolve
from data.chat import configure_chat_template
from data.dataset import cache_root
from data.errors import DataError
from data.open_dataset import open_dataset
from data.pair_dataset import PairDataset
from models.tokenizer import configured_tokenizer
from schema.checks import check_config
from schema.compose import compose_config
from schema.train import evaluating, tokenizer_sources


def main(argv: list[str] | None = None) -> int:
    overrides = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("-h", "--help")]
    if argv is None and len(overrides) != len(sys.argv) - 1:
        print(__doc__)
        return 0
    try:
        cfg = compose_config(overrides)
        check_config(cfg)  # what depends on the machine that trains is checked there
        d = cfg.data
        if d.cache_dir == "":
            raise ValueError("data.cache_dir='' keeps tokenized data only for one run: nothing to prepare")
        cache, _ = cache_root(d.cache_dir, cfg.output_dir)
        names = [resolve(p, k, cfg.model_revision, weights=False) for k, p in tokenizer_sources(cfg)]
        tokenizer = configure_chat_template(configured_tokenizer(*names)[0], d)
        files = [(cfg.train_file, True)] if cfg.do_train else []
        files += [(cfg.eval_file, False)] if evaluating(cfg) else []
        if not files:
            raise ValueError("train_file (or eval_file) is not set: nothing to prepare")
        for spec, train in files:
            ds = open_dataset(cfg, spec, tokenizer, train=train, cache_dir=cache, log=lambda s: print(s, flush=True))
            how = "found" if ds.from_cache else "built"
            what = "pairs" if isinstance(ds, PairDataset) else "rows"
            print(
                f"{spec}: {len(ds):,} {what}, {ds.report()['tokens']:,} tokens, store {how}: "
                f"{', '.join(ds.store_dirs)}",
                flush=True,
            )
    except (DataError, ValueError, HubError) as e:
        print(f"data.prepare: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
