"""Rows -> token ids and target masks, exactly as inference tokenizes them.

Rows are `{"text": ...}` (loss on every next token), `{"prompt": ..., "response": ...}` (loss on the
response tokens only) or `{"messages": [...]}` (a chat through the tokenizer's template, loss on the
assistant turns). Text and prompts are tokenized the way the tokenizer does by default (its own BOS/EOS
handling); a response is tokenized without special tokens and followed by EOS (`data.add_eos_to_response`)
so the model learns where an answer ends.

`encode_row` is the rule; `encode_rows` applies it to a chunk of rows with one batched tokenizer call per
row kind (the fast tokenizer is several times faster on a list than called per row) and gives exactly
`encode_row`'s ids and targets (tests/test_data.py holds them equal for both tokenizer kinds).
"""

from __future__ import annotations

import json

from data.chat import chat_spans, targets_from_spans
from data.errors import DataError
from schema.data import DataConfig


def encode_messages(messages, tokenizer, cfg: DataConfig | None = None) -> tuple[list[int], list[bool]]:
    """A chat rendered with the chat template once and tokenized once, exactly as inference tokenizes it
    (`tokenizer(rendered, add_special_tokens=False)`, what `apply_chat_template(tokenize=True)` does); targets: the
    assistant turns as they stand in that rendering (`data.train_on`: all of them or the last), found by
    data/chat.py's rules. A tokenizer without character offsets, or one whose offsets lose characters, is refused."""
    cfg = cfg or DataConfig()
    check_messages(messages)
    text, spans = chat_spans(messages, tokenizer, cfg)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, TypeError, ValueError):
        raise KeyError(
            f"chat rows need a tokenizer with character offsets (a fast tokenizer, tokenizer.json); "
            f"{type(tokenizer).__name__} has none"
        ) from None
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    check_offsets(text, offsets)
    return list(ids), targets_from_spans(offsets, spans)


def check_messages(messages) -> None:
    """KeyError unless `messages` is a non-empty list of {role, content} (content may be absent with tool_calls)."""
    if not isinstance(messages, list) or not messages:
        raise KeyError("'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if content is None and isinstance(m, dict) and m.get("tool_calls"):
            content = ""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, str):
            raise KeyError("every message needs a string 'role' and a string 'content'")
        check_unicode(content, f"messages[{i}].content")


def check_tool_turns(messages: list[dict], template) -> None:
    """KeyError when the conversation has tool calls or tool answers (ShareGPT's function_call and observation
    turns) and the chat template has no place for them: it would render them as something else, or drop them."""
    import re

    text = template if isinstance(template, str) else json.dumps(template)
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in text:
        raise KeyError(
            "the tokenizer's chat template has no tool calls ('tool_calls'): function_call turns cannot "
            "be rendered with it"
        )
    if any(m.get("role") == "tool" for m in messages) and not re.search(r"""['"]tool['"]""", text):
        raise KeyError("the tokenizer's chat template has no 'tool' role: observation turns cannot be rendered with it")


def check_offsets(text: str, offsets) -> None:
    """KeyError unless the tokens' character offsets cover every character of `text` but whitespace.

    A tokenizer that drops characters it cannot encode (sentencepiece without byte fallback drops the `[`
    and `]` of "[INST]") returns offsets that no longer match the text, and targets found by offset would
    land on the wrong tokens."""
    covered = bytearray(len(text))
    for start, end in offsets:
        if not 0 <= start <= end <= len(text):
            raise KeyError(_DROPPED.format(where=f"an offset ({start}, {end}) beyond the text"))
        covered[start:end] = b"\x01" * (end - start)
    missing = [i for i, c in enumerate(text) if not covered[i] and not c.isspace()]
    if missing:
        raise KeyError(_DROPPED.format(where=f"{text[missing[0]]!r} at character {missing[0]}"))


_DROPPED = (
    "the tokenizer does not represent every character of this conversation ({where}): its offsets do not "
    "match the text, so the chat targets cannot be placed; use a tokenizer with byte fallback"
)


def lossy_tokenizer(tokenizer) -> bool:
    """Whether the tokenizer can drop or replace characters (an unknown token): not byte-level BPE (Llama-3,
    Qwen, GPT-2) and not a vocabulary with byte fallback (Llama-2's sentencepiece). Those rows are checked."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return True
    spec = json.loads(backend.to_str())

    def byte_level(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(byte_level(v) for v in node.values())
        return isinstance(node, list) and any(byte_level(v) for v in node)

    model = spec.get("model") or {}
    vocab = model.get("vocab") or {}
    pieces = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}
    # NOTE: transformers' sentencepiece conversion sets byte_fallback even for a vocabulary without the 256 byte
    # pieces, and a character then falls back to bytes that do not exist: it is dropped.
    fallback = model.get("byte_fallback") and all(f"<0x{b:02X}>" in pieces for b in range(256))
    return not (fallback or byte_level(spec.get("pre_tokenizer")))


def lost_characters(texts: list[str], ids: list[list[int]], tokenizer) -> list[bool]:
    """Per text: does decoding its ids lose or replace a character (whitespace aside)?"""
    decode = tokenizer.batch_decode
    decoded = decode(ids, skip_special_tokens=True)
    return ["".join(a.split()) != "".join(b.split()) for a, b in zip(texts, decoded, strict=True)]


def check_unicode(text: str, key: str) -> None:
    """KeyError when `text` cannot be encoded as UTF-8 (a lone surrogate such as "\\ud800" from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KeyError(
            f"'{key}' is not valid Unicode (a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start})"
        ) from None


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
        raise KeyError(
            f"row has both {kinds[0][1]} and {kinds[1][1]}: a row is one kind (text, prompt/response "
            "or messages); drop the other keys"
        )
    if not kinds:
        raise KeyError(
            f"row has neither a string '{cfg.text_key}' nor '{cfg.prompt_key}'/'{cfg.response_key}' "
            f"nor '{cfg.messages_key}' (nor alpaca's '{cfg.instruction_key}' or ShareGPT's '{cfg.conversations_key}')"
        )
    return kinds[0][0]


def encode_row(row: dict, tokenizer, cfg: DataConfig) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is a target (predicted from the tokens before it). KeyError: a bad row."""
    kind = row_kind(row, cfg)
    if kind == "messages":
        return encode_messages(row[cfg.messages_key], tokenizer, cfg)
    _check_strings(row, kind, cfg)
    if kind == "pair":
        p = tokenizer(row[cfg.prompt_key])["input_ids"]
        r = tokenizer(row[cfg.response_key], add_special_tokens=False)["input_ids"]
        if cfg.add_eos_to_response and tokenizer.eos_token_id is not None:
            r = r + [tokenizer.eos_token_id]
        return p + r, [False] * len(p) + [True] * len(r)
    ids = tokenizer(row[cfg.text_key])["input_ids"]
    return ids, [True] * len(ids)


def encode_rows(
    rows: list[tuple[str, dict]], tokenizer, cfg: DataConfig, lost: list[bool] | None = None
) -> list[tuple[list[int], list[bool]]]:
    """`encode_row` of every (location, row), text and prompt/response rows tokenized in batches.

    With `lost` (a list), it receives per row whether the tokenizer lost or replaced one of the row's
    characters (`lost_characters`; chat rows that would are refused by `check_offsets`).

    Raises:
        DataError: a bad row, naming its location.
    """
    kinds = []
    for where, row in rows:
        try:
            kinds.append(row_kind(row, cfg))
            _check_strings(row, kinds[-1], cfg)
        except KeyError as e:
            raise DataError(f"{where}: {e.args[0]}") from None
    out: list = [None] * len(rows)
    lost_by_row: dict[int, bool] = {}
    text = [i for i, k in enumerate(kinds) if k == "text"]
    if text:
        ids = tokenizer([rows[i][1][cfg.text_key] for i in text], return_attention_mask=False)["input_ids"]
        for i, row_ids in zip(text, ids, strict=True):
            out[i] = (row_ids, [True] * len(row_ids))
        if lost is not None:
            flags = lost_characters([rows[i][1][cfg.text_key] for i in text], ids, tokenizer)
            lost_by_row.update(zip(text, flags, strict=True))
    pairs = [i for i, k in enumerate(kinds) if k == "pair"]
    if pairs:
        prompts = tokenizer([rows[i][1][cfg.prompt_key] for i in pairs], return_attention_mask=False)["input_ids"]
        responses = tokenizer(
            [rows[i][1][cfg.response_key] for i in pairs], add_special_tokens=False, return_attention_mask=False
        )["input_ids"]
        eos = [tokenizer.eos_token_id] if cfg.add_eos_to_response and tokenizer.eos_token_id is not None else []
        for i, p, r in zip(pairs, prompts, responses, strict=True):
            out[i] = (p + r + eos, [False] * len(p) + [True] * (len(r) + len(eos)))
        if lost is not None:
            texts = [rows[i][1][k] for k in (cfg.prompt_key, cfg.response_key) for i in pairs]
            flags = lost_characters(texts, prompts + responses, tokenizer)
            lost_by_row.update((i, a or b) for i, a, b in zip(pairs, flags[: len(pairs)], flags[len(pairs) :]))
    for i, kind in enumerate(kinds):
        if kind == "messages":
            try:
                out[i] = encode_messages(rows[i][1][cfg.messages_key], tokenizer, cfg)
            except KeyError as e:
                raise DataError(f"{rows[i][0]}: {e.args[0]}") from None
    if lost is not None:
        lost[:] = [lost_by_row.get(i, False) for i in range(len(rows))]
    return out


def _check_strings(row: dict, kind: str, cfg: DataConfig) -> None:
    """The checks `encode_row` makes before tokenizing a text or prompt/response row (KeyError)."""
    if kind == "pair":
        prompt, response = row.get(cfg.prompt_key), row.get(cfg.response_key)
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise KeyError(f"rows with '{cfg.prompt_key}' need string '{cfg.prompt_key}' and '{cfg.response_key}'")
        check_unicode(prompt, cfg.prompt_key)
        check_unicode(response, cfg.response_key)
    elif kind == "text":
        if not isinstance(row[cfg.text_key], str):
            raise KeyError(f"'{cfg.text_key}' must be a string, got {type(row[cfg.text_key]).__name__}")
        check_unicode(row[cfg.text_key], cfg.text_key)
