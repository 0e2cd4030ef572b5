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


def configured_tokenizer(tokenizer_name_or_path: str | None, model_name_or_path: str | None):
    """(tokenizer, where) for a run: `tokenizer_name_or_path`, else `model_name_or_path`'s; `where` names the setting
    and the path for messages. Raises ValueError (one line)."""
    if tokenizer_name_or_path:
        path, setting = tokenizer_name_or_path, "tokenizer_name_or_path"
    elif model_name_or_path:
        path, setting = model_name_or_path, "model_name_or_path"
    else:
        raise ValueError("tokenizer_name_or_path (or model_name_or_path) is not set")
    return load_tokenizer(path, setting), f"{setting} {path}"


def check_tokenizer_fits(num_tokens: int, vocab_size: int, where: str) -> None:
    """len(tokenizer) must not exceed the embedding rows (ids beyond it index nothing). Raises ValueError."""
    if num_tokens > vocab_size:
        raise ValueError(
            f"{where}: tokenizer has {num_tokens} tokens but the embedding has vocab_size={vocab_size} rows "
            "(was a pad token added without resizing the model?)"
        )
