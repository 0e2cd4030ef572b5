"""Loading a tokenizer and checking it fits the model's embedding (one place for both)."""

from __future__ import annotations

import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str, setting: str = "tokenizer_name_or_path"):
    """`AutoTokenizer` from `path`. Raises ValueError (one line, naming `setting` and the path)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) or not has_tokenizer(path):
        raise ValueError(
            f"{setting} {path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
            "point tokenizer_name_or_path at the model's tokenizer"
        )
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"{setting} {path}: cannot load the tokenizer ({first})") from None


def check_tokenizer_fits(num_tokens: int, vocab_size: int, where: str) -> None:
    """len(tokenizer) must not exceed the embedding rows (ids beyond it index nothing). Raises ValueError."""
    if num_tokens > vocab_size:
        raise ValueError(
            f"{where}: tokenizer has {num_tokens} tokens but the embedding has vocab_size={vocab_size} rows "
            "(was a pad token added without resizing the model?)"
        )
