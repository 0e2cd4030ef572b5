"""What the packing report must say, found from the data itself and not from the code under test (data/packing.py):
the rows as the trainer encodes them, and best-fit decreasing written again from its description."""

from __future__ import annotations

import pytest

from tests.conftest import read_jsonl


def packing_reference(hf_dir: str, train_file: str, seq_length: int) -> tuple[int, list[int]]:
    """(rows, each row's length) of `train_file` as the trainer encodes prompt/response rows, found here without the
    trainer's data code: the prompt's tokens, the response's without special tokens, EOS; cut to `seq_length`."""
    from transformers import AutoTokenizer

    tokenizer, rows = AutoTokenizer.from_pretrained(hf_dir), read_jsonl(train_file)
    ids = [
        len(tokenizer(r["prompt"])["input_ids"]) + len(tokenizer(r["response"], add_special_tokens=False)["input_ids"])
        for r in rows
    ]
    return len(rows), [min(n + 1, seq_length) for n in ids]


def best_fit_decreasing(lengths: list[int], capacity: int) -> int:
    """How many rows of `capacity` best-fit decreasing packs `lengths` into (longest first, each into the fullest
    row it fits), written here as docs/training.md describes it, apart from data/packing.py."""
    free: list[int] = []
    for n in sorted(lengths, reverse=True):
        fits = [i for i, room in enumerate(free) if room >= n]
        if fits:
            free[min(fits, key=lambda i: free[i])] -= n
        else:
            free.append(capacity - n)
    return len(free)


def assert_packing_report(report: dict, hf_dir: str, train_file: str, seq_length: int) -> None:
    """A packed run's data report (`data_report.json`'s "train") equals what the data itself gives: its tokens,
    packed rows, rows per packed row and the padding shares before and after packing."""
    rows, lengths = packing_reference(hf_dir, train_file, seq_length)
    packed = best_fit_decreasing(lengths, seq_length)
    assert (report["tokens"], report["packed_rows"]) == (sum(lengths), packed), (report, sum(lengths), packed)
    assert report["rows_per_packed_row"] == pytest.approx(rows / packed, rel=1e-12)
    assert report["padding_share_unpacked"] == pytest.approx(1 - sum(lengths) / (rows * seq_length))
    assert report["padding_share_packed"] == pytest.approx(1 - sum(lengths) / (packed * seq_length))
    print(
        f"packing: {report['rows_per_packed_row']:.2f} rows per packed row, padding "
        f"{report['padding_share_unpacked']:.1%} -> {report['padding_share_packed']:.1%}"
    )
