"""The demo task: two-digit addition, "23+58=" -> "81", loss on the answer only."""

from __future__ import annotations

import os
import random

from data.sources import write_jsonl


def addition_rows(seed: int = 0) -> list[dict]:
    """All 10,000 sums a+b with 0 <= a, b < 100, shuffled with `seed`."""
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(rows)
    return rows


def write_splits(out_dir: str, num_eval: int = 1000, seed: int = 0) -> tuple[str, str]:
    """train.jsonl (9,000 sums) and eval.jsonl (1,000 held-out sums)."""
    rows = addition_rows(seed)
    train = write_jsonl(os.path.join(out_dir, "train.jsonl"), rows[num_eval:])
    evals = write_jsonl(os.path.join(out_dir, "eval.jsonl"), rows[:num_eval])
    return train, evals
