"""JSONL datasets: one row, one sequence.

Rows are `{"text": ...}` (loss on every next token) or `{"prompt": ..., "response": ...}` (loss on
the response tokens only). Text and prompts are tokenized the way the tokenizer does by default
(its own BOS/EOS handling); a response is tokenized without special tokens and followed by EOS
(`data.add_eos_to_response`) so the model learns where an answer ends. Sequences are truncated
to `seq_length`. No row is ever dropped: a row with no target token left after truncation still
counts as a sample and contributes nothing to the loss, so every rank agrees on the row count.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from torch.utils.data import Dataset

from data import sources
from data.config import DataConfig
from data.errors import DataError
from data.sources import count_rows

__all__ = ["DataError", "TokenizedDataset", "PlaceholderDataset", "count_rows", "encode_row"]


def _encode_chunk(args) -> list[tuple[list[int], list[bool]]]:
    rows, tokenizer, cfg = args
    out = []
    for where, row in rows:
        try:
            out.append(encode_row(row, tokenizer, cfg))
        except KeyError as e:
            raise DataError(f"{where}: {e.args[0]}") from None
    return out


def _encode_all(rows, tokenizer, cfg: DataConfig, workers: int) -> list[tuple[list[int], list[bool]]]:
    """encode_row over every (location, row), in `workers` processes when > 1 (order kept)."""
    if workers <= 1 or len(rows) < 2 * workers:
        return _encode_chunk((rows, tokenizer, cfg))
    import multiprocessing

    size = -(-len(rows) // (workers * 4))
    chunks = [(rows[i : i + size], tokenizer, cfg) for i in range(0, len(rows), size)]
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        return [item for part in pool.map(_encode_chunk, chunks) for item in part]


def cache_key(path, tokenizer, seq_length: int, cfg: DataConfig, weights, seed: int) -> str:
    """What the tokenized rows depend on: the files as they are now, the mixture, tokenizer and settings."""
    files = []
    for p in sources.paths_of(path):
        parts = [p] if not os.path.isdir(p) else sorted(os.path.join(p, n) for n in os.listdir(p))
        files.append([(os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns) for f in parts])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = {k: str(v) for k, v in tokenizer.special_tokens_map.items()}
    key = {
        "version": 1,
        "files": files,
        "weights": weights,
        "seed": seed if weights else None,
        "seq_length": seq_length,
        "data": {
            k: getattr(cfg, k)
            for k in ("text_key", "prompt_key", "response_key", "messages_key", "add_eos_to_response")
        },  # fmt: skip
        "tokenizer": hashlib.sha256(vocab.encode()).hexdigest(),
        "special": special,
        "chat_template": getattr(tokenizer, "chat_template", None),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def encode_messages(messages, tokenizer) -> tuple[list[int], list[bool]]:
    """A chat rendered with the tokenizer's chat template; targets: the assistant turns only.

    The whole conversation is rendered once and tokenized once, exactly as inference tokenizes it
    (`tokenizer(rendered, add_special_tokens=False)`, what `apply_chat_template(tokenize=True)` does),
    so training sees the token sequence serving produces. Each assistant turn's target is the text the
    template writes after the assistant header: the conversation up to that turn rendered with
    `add_generation_prompt=True` is its context, the rendering including the turn ends it. A token is a
    target when its characters (the tokenizer's offsets) fall inside such a span; a token straddling a
    boundary belongs to the span it overlaps. Templates must render a conversation's prefix as a prefix
    of the whole (every common one does); one that does not is reported, as is a tokenizer without offsets.
    """
    if not isinstance(messages, list) or not messages:
        raise KeyError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise KeyError("every message needs a string 'role' and a string 'content'")
        check_unicode(m["content"], f"messages[{i}].content")
    if not getattr(tokenizer, "chat_template", None):
        raise KeyError("rows with 'messages' need a tokenizer with a chat template (tokenizer_config.json)")

    def render(turns, generation_prompt=False) -> str:
        if not turns:
            return ""
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or what the template itself raises
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise KeyError(f"the tokenizer's chat template refused this conversation: {reason}") from None

    text = render(messages)
    spans = []  # [start, end) character spans of the assistant turns in `text`
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        context, upto = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
        if not (upto.startswith(context) and text.startswith(upto)):
            raise KeyError("the chat template does not render a conversation's start as a prefix of the whole")
        if len(upto) > len(context):
            spans.append((len(context), len(upto)))
    if not spans:
        raise KeyError("conversation has no assistant turn to learn from")
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        raise KeyError(
            f"chat rows need a tokenizer with character offsets (a fast tokenizer, tokenizer.json); "
            f"{type(tokenizer).__name__} has none"
        ) from None
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]

    def is_target(start: int, end: int) -> bool:
        if start == end:  # zero-width (e.g. a trimmed offset): the span its position falls in
            return any(s <= start < e for s, e in spans)
        return any(start < e and end > s for s, e in spans)

    return list(ids), [is_target(start, end) for start, end in offsets]


def check_unicode(text: str, key: str) -> None:
    """KeyError when `text` cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800" from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KeyError(f"'{key}' is not valid Unicode (a lone surrogate \\u{ord(text[e.start]):04x} at character "
                       f"{e.start})") from None  # fmt: skip


def row_kind(row: dict, cfg: DataConfig) -> str:
    """'messages', 'pair' or 'text': which of the row kinds `row` is (a key set to null counts as absent).
    A row with keys of two kinds is ambiguous: KeyError."""
    kinds = []
    if row.get(cfg.messages_key) is not None:
        kinds.append(("messages", f"'{cfg.messages_key}'"))
    if row.get(cfg.prompt_key) is not None or row.get(cfg.response_key) is not None:
        kinds.append(("pair", f"'{cfg.prompt_key}'/'{cfg.response_key}'"))
    if row.get(cfg.text_key) is not None:
        kinds.append(("text", f"'{cfg.text_key}'"))
    if len(kinds) > 1:
        raise KeyError(f"row has both {kinds[0][1]} and {kinds[1][1]}: a row is one kind (text, prompt/response "
                       "or messages); drop the other keys")  # fmt: skip
    if not kinds:
        raise KeyError(
            f"row has neither a string '{cfg.text_key}' nor '{cfg.prompt_key}'/'{cfg.response_key}' "
            f"nor '{cfg.messages_key}'"
        )
    return kinds[0][0]


def encode_row(row: dict, tokenizer, cfg: DataConfig) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is a target (predicted from the tokens before it)."""
    kind = row_kind(row, cfg)
    if kind == "messages":
        return encode_messages(row[cfg.messages_key], tokenizer)
    if kind == "pair":
        prompt, response = row.get(cfg.prompt_key), row.get(cfg.response_key)
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise KeyError(f"rows with '{cfg.prompt_key}' need string '{cfg.prompt_key}' and '{cfg.response_key}'")
        check_unicode(prompt, cfg.prompt_key)
        check_unicode(response, cfg.response_key)
        p = tokenizer(prompt)["input_ids"]
        r = tokenizer(response, add_special_tokens=False)["input_ids"]
        if cfg.add_eos_to_response and tokenizer.eos_token_id is not None:
            r = r + [tokenizer.eos_token_id]
        return p + r, [False] * len(p) + [True] * len(r)
    text = row[cfg.text_key]
    if not isinstance(text, str):
        raise KeyError(f"'{cfg.text_key}' must be a string, got {type(text).__name__}")
    check_unicode(text, cfg.text_key)
    ids = tokenizer(text)["input_ids"]
    return ids, [True] * len(ids)


class TokenizedDataset(Dataset):
    """Rows tokenized in memory. Index -1 is a padding sample (no tokens, no targets).

    With `cache_dir`, the tokenized rows are stored there under a key of the data files (path, size,
    modification time), the mixture, the tokenizer, `seq_length` and the data settings, and loaded
    instead of tokenizing again (a restart, the other ranks). `workers` > 1 tokenizes in that many
    processes.
    """

    def __init__(self, path, tokenizer, seq_length: int, cfg: DataConfig, weights=None, seed: int = 0,
                 cache_dir: str | None = None, workers: int = 0):  # fmt: skip
        """`path`: one data file (JSONL, JSON, Parquet, a datasets directory) or a list, mixed by `weights`."""
        self.path = path
        self.cache_file, self.from_cache = None, False
        if cache_dir:
            key = cache_key(path, tokenizer, seq_length, cfg, weights, seed)
            self.cache_file = os.path.join(cache_dir, f"tokenized-{key}.pt")
            if os.path.exists(self.cache_file):
                state = torch.load(self.cache_file, weights_only=True)
                self.samples = list(zip(state["ids"], state["targets"], strict=True))
                self.truncated, self.no_target_lines, self.from_cache = state["truncated"], state["no_target"], True
                return
        rows = sources.read_rows(path, weights, seed)
        unique = list(dict.fromkeys(where for where, _ in rows))  # a mixture may repeat rows: tokenize each once
        by_where = dict(rows)
        encoded = dict(
            zip(unique, _encode_all([(w, by_where[w]) for w in unique], tokenizer, cfg, workers), strict=True)
        )
        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.truncated = 0
        self.no_target_lines: list[str] = []  # "file:line" of rows that teach nothing (logged by the trainer)
        for where, _ in rows:
            ids, targets = encoded[where]
            self.truncated += len(ids) > seq_length
            self.samples.append(
                (torch.tensor(ids[:seq_length], dtype=torch.long), torch.tensor(targets[:seq_length], dtype=torch.bool))
            )
            if not any(targets[1:seq_length]):  # position 0 is never predicted
                self.no_target_lines.append(where)
        if self.samples and len(self.no_target_lines) == len(self.samples):
            raise DataError(
                f"{path}: none of the {len(self.samples)} rows has a target token within seq_length={seq_length} "
                "(prompts that fill seq_length, or empty responses)"
            )
        if self.cache_file:
            os.makedirs(cache_dir, exist_ok=True)
            tmp = f"{self.cache_file}.tmp-{os.getpid()}"
            state = {
                "ids": [ids for ids, _ in self.samples],
                "targets": [t for _, t in self.samples],
                "truncated": self.truncated,
                "no_target": self.no_target_lines,
            }
            torch.save(state, tmp)
            os.replace(tmp, self.cache_file)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == -1:
            return torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool)
        return self.samples[index]

    def report(self) -> dict:
        """What training will see: rows, tokens after truncation, truncated rows, share of target tokens."""
        tokens = sum(len(ids) for ids, _ in self.samples)
        targets = self.target_tokens()
        return {
            "file": self.path,
            "rows": len(self.samples),
            "tokens": tokens,
            "target_tokens": targets,
            "target_share": targets / tokens if tokens else 0.0,
            "truncated_rows": self.truncated,
            "rows_without_targets": len(self.no_target_lines),
        }

    def target_tokens(self) -> int:
        return sum(int(t[1:].sum()) for _, t in self.samples)

    def fingerprint(self) -> str:
        """sha256 of the tokenized rows in dataset order (ids and targets): what training reads, whatever
        files, mixture, tokenizer and settings produced it. A resume compares it (training/checkpointing.py)."""
        digest = hashlib.sha256()
        for ids, targets in self.samples:
            digest.update(len(ids).to_bytes(8, "little"))
            digest.update(ids.numpy().tobytes())
            digest.update(targets.numpy().tobytes())
        return digest.hexdigest()


class PlaceholderDataset(Dataset):
    """What middle pipeline stages get: the row count and nothing else. They never read data."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int):
        raise RuntimeError("a middle pipeline stage never reads data")
