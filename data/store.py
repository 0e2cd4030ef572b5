"""The tokenized store: one data source tokenized once into flat arrays on disk that every rank memory-maps.

    <cache_dir>/store-<key>/        complete: it appears only by rename, after meta.json is written
        meta.json                   rows, tokens, dtypes, fingerprint, report counts, the key it was built for
        tokens.bin                  every row's token ids end to end (uint16, or uint32 for vocabularies > 65,536)
        targets.bin                 one bit per token: is it a target (np.packbits, little bit order)
        offsets.npy                 int64 [rows + 1]: row r is tokens[offsets[r]:offsets[r + 1]]
        lengths.npy                 int32 [rows]: tokens kept per row (after truncation)
        full_lengths.npy            int32 [rows]: tokens before truncation (the report's truncated rows)
        row_targets.npy             int32 [rows]: target tokens per row that the loss sees (positions >= 1)
        lost_characters.npy         uint8 [rows]: 1 where the tokenizer dropped or replaced a character
    <cache_dir>/store-<key>.partial/  while building: part-NNNNNN/ per chunk of CHUNK_ROWS rows
    <cache_dir>/store-<key>.lock      held while building (a second builder waits, then opens the result)

Megatron-style arrays rather than Arrow through `datasets`: reading a row is two slices of memory-mapped
files (a few microseconds, no Python objects per row), the per-row arrays the samplers, packing and the
report need are one memory-mapped array each, and nothing else is imported at run time. The key is what
the tokenized rows depend on (the source files' paths, sizes and modification times, the tokenizer, the
data settings, the truncation); the data order (mixture, shuffle) is not part of it.

Building one (streamed in chunks, in worker processes, resumable, atomic) is data/store_builder.py.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from data.sources import hub_dataset, is_hub_dataset, shard_files
from schema.data import DataConfig

# The settings of data/formats.py: how alpaca and ShareGPT rows become our rows.
FORMAT_KEYS = (
    "format",
    "instruction_key",
    "input_key",
    "output_key",
    "system_key",
    "history_key",
    "conversations_key",
    "role_tag",
    "content_tag",
    "user_tag",
    "assistant_tag",
    "system_tag",
    "function_tag",
    "observation_tag",
)

VERSION = 2
CHUNK_ROWS = 4096
NO_TARGET_EXAMPLES = 5
META = "meta.json"


# Per-row arrays (offsets has one entry more) and their types.
ARRAYS = {
    "offsets": np.int64,
    "lengths": np.int32,
    "full_lengths": np.int32,
    "row_targets": np.int32,
    "lost_characters": np.uint8,
}


def tokenizer_identity(tokenizer) -> dict:
    """What the ids depend on: the vocabulary and rules, the special tokens, the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    return {
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
        "special": {k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        "chat_template": getattr(tokenizer, "chat_template", None),
        "size": len(tokenizer),
    }


# What chat and pair rows' tokens and targets also depend on (data.chat_template acts through the tokenizer's).
CHAT_KEYS = ("train_on", "chat_template_kwargs", "chosen_key", "rejected_key")


def store_key(
    path: str, tokenizer, cfg: DataConfig, truncate: int | None, concat: bool, pairs: bool = False
) -> tuple[str, dict]:
    """(name, description) of the store for `path` tokenized with these settings (`pairs`: as preference pairs)."""
    if is_hub_dataset(path):  # the same on every node and in every directory: datasets' own content identity
        files = [hub_dataset(path)._fingerprint]
    else:
        files = [(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in shard_files(path)]
    key = {
        "version": VERSION,
        "chunk_rows": CHUNK_ROWS,
        "source": path if is_hub_dataset(path) else os.path.abspath(path),
        "files": files,
        "data": {
            k: getattr(cfg, k)
            for k in ("text_key", "prompt_key", "response_key", "messages_key", "add_eos_to_response")
        },
        "truncate": truncate,
        "concat": concat,  # documents end with EOS (data.concatenate)
        **tokenizer_identity(tokenizer),
    }
    if pairs:  # (only then: the names of other stores stay what they were)
        key["pairs"] = True
    defaults = DataConfig()
    chat = {k: getattr(cfg, k) for k in CHAT_KEYS if getattr(cfg, k) != getattr(defaults, k)}
    if chat:  # chat and pair settings that differ from the defaults (stores of the defaults keep their names)
        key["chat"] = {k: v if isinstance(v, dict) else str(v) for k, v in chat.items()}
    formats = {k: str(getattr(cfg, k)) for k in FORMAT_KEYS if getattr(cfg, k) != getattr(DataConfig, k)}
    if formats:  # alpaca / ShareGPT settings that differ from the defaults (the same rule)
        key["formats"] = formats
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return f"store-{digest}", key


class Store:
    """A complete store, memory-mapped: nothing is read until a row is."""

    def __init__(self, directory: str):
        self.directory = directory
        with open(os.path.join(directory, META)) as f:
            self.meta = json.load(f)
        self.rows, self.num_tokens = self.meta["rows"], self.meta["tokens"]
        self.tokens = (
            np.memmap(
                os.path.join(directory, "tokens.bin"),
                dtype=self.meta["token_dtype"],
                mode="r",
                shape=(self.num_tokens,),
            )
            if self.num_tokens
            else np.zeros(0, np.uint16)
        )
        nbytes = (self.num_tokens + 7) // 8
        self.target_bits = (
            np.memmap(os.path.join(directory, "targets.bin"), dtype=np.uint8, mode="r", shape=(nbytes,))
            if nbytes
            else np.zeros(0, np.uint8)
        )
        for name in ARRAYS:
            setattr(self, name, np.load(os.path.join(directory, f"{name}.npy"), mmap_mode="r"))

    def span(self, row: int, start: int = 0, end: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (int64) and target flags (bool) of tokens [start, end) of `row`."""
        base = int(self.offsets[row])
        stop = int(self.offsets[row + 1]) if end is None else base + end
        lo, hi = base + start, stop
        ids = np.asarray(self.tokens[lo:hi], dtype=np.int64)
        bits = np.unpackbits(self.target_bits[lo // 8 : (hi + 7) // 8], bitorder="little")
        return ids, bits[lo % 8 : lo % 8 + (hi - lo)].astype(bool)

    @property
    def fingerprint(self) -> str:
        return self.meta["fingerprint"]
