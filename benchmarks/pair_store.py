"""Building the tokenized store of preference pairs (`objective=dpo`) against SFT prompt/response rows on the same
texts: pairs/s, sequences/s and tokens/s, medians of repeated builds, one process.

    python -m benchmarks.pair_store [--pairs 20000,200000 --repeat 3]

The pairs are sums (`{"prompt": "12+30=", "chosen": " 42", "rejected": " 43"}`), tokenized by a byte-level BPE
tokenizer trained on the fly; the SFT rows are each pair's prompt and chosen completion.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        rows.append({"prompt": f"{a}+{b}=", "chosen": f" {a + b}", "rejected": f" {wrong}"})
    return rows


def main() -> None:
    from transformers import AutoTokenizer

    from data.dataset import TokenizedDataset
    from data.pair_dataset import PairDataset
    from schema.data import DataConfig
    from tools.tiny_models import SAMPLE_TEXTS, make_bpe_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="20000,200000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        tok = AutoTokenizer.from_pretrained(make_bpe_tokenizer(f"{work}/tok", SAMPLE_TEXTS * 20, vocab_size=320))
        for n in (int(x) for x in args.pairs.split(",")):
            pairs = arithmetic_pairs(n)
            files = {"pairs": f"{work}/pairs-{n}.jsonl", "sft rows": f"{work}/sft-{n}.jsonl"}
            with open(files["pairs"], "w") as f:
                f.writelines(json.dumps(p) + "\n" for p in pairs)
            with open(files["sft rows"], "w") as f:
                f.writelines(json.dumps({"prompt": p["prompt"], "response": p["chosen"]}) + "\n" for p in pairs)
            for name, kind in (("pairs", PairDataset), ("sft rows", TokenizedDataset)):
                times = []
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    ds = kind(files[name], tok, 64, DataConfig())  # a fresh temporary cache: built every time
                    times.append(time.perf_counter() - start)
                seconds = statistics.median(times)
                sequences = 2 * n if name == "pairs" else n
                tokens = int(ds.report()["tokens"])
                print(
                    f"{n:>8} {name:<8}: {n / seconds:>9,.0f}/s, {sequences / seconds:>9,.0f} sequences/s, "
                    f"{tokens / seconds:>10,.0f} tokens/s (median of {args.repeat} builds)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
