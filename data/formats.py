"""LLaMA-Factory's dataset formats, alpaca and ShareGPT, read as the rows of data/encode.py and data/pairs.py.

The format is detected per file from the keys of its first row (`data.format` forces one): ShareGPT when the row
has `data.conversations_key`, alpaca when it has `data.instruction_key`, else our own rows (text, prompt/response,
messages, pairs). Each row is rendered as LLaMA-Factory renders it (`data/converter.py` there) and becomes the
same conversation written as `messages` (or, for preference pairs, TRL's conversational pair), so it gives
exactly the tokens and targets of that conversation through the tokenizer's chat template:

- alpaca: `system` is the system turn, the `history` [user, assistant] pairs come first, the user turn is
  `instruction + "\\n" + input` (the input left out when empty), `output` is the assistant turn; a ranking row has
  `chosen` / `rejected` strings instead of `output`.
- ShareGPT: `conversations` of {from, value}: human -> user, gpt -> assistant, system (first turn only) -> system,
  function_call -> an assistant tool call (`tool_calls`), observation -> the `tool` role. Turns alternate as
  LLaMA-Factory requires (user or observation, then gpt or function_call); a ranking row ends on a user turn and
  has `chosen` / `rejected` turns.

A row that does not fit its file's format is a KeyError naming what is wrong (the caller adds file and line).
"""

from __future__ import annotations

import json

from data.encode import check_tool_turns
from schema.data import DataConfig, DataFormat

FORMATS = tuple(str(f) for f in DataFormat if f != DataFormat.auto)


def detect_format(row, cfg: DataConfig) -> str:
    """The format of a file whose first row is `row`: `data.format` when set, else from the row's keys. A row with
    one of our own keys (text, prompt/response, messages) is ours, whatever else it carries (the original alpaca
    set has a 'text' column beside instruction/input/output, and stays read as text)."""
    if cfg.format != DataFormat.auto:
        return str(cfg.format)
    ours = (cfg.text_key, cfg.prompt_key, cfg.response_key, cfg.messages_key)
    if not isinstance(row, dict) or any(key in row for key in ours):
        return "native"
    if cfg.conversations_key in row:
        return "sharegpt"
    if cfg.instruction_key in row:
        return "alpaca"
    return "native"


def to_native(row, fmt: str, cfg: DataConfig, pairs: bool, chat_template=None) -> dict:
    """`row` of format `fmt` as our own row: {messages_key: [...]} or, with `pairs`, a conversational pair.
    `chat_template` (the tokenizer's) must have a place for ShareGPT's function_call and observation turns."""
    if fmt == "native":
        return row
    if not isinstance(row, dict):
        raise KeyError(f"a {fmt} row must be a JSON object")
    if fmt == "alpaca":
        return _alpaca(row, cfg, pairs)
    out = _sharegpt(row, cfg, pairs)
    check_tool_turns([m for v in out.values() for m in v], chat_template or "")
    return out


def chunk_as_native(rows: list[tuple[str, dict]], cfg: DataConfig, pairs: bool, chat_template=None):
    """(rows as our own rows, the format they were read as) for a chunk of one file's (location, row) pairs; the
    format comes from the first row. DataError naming the row's location when one does not fit."""
    from data.errors import DataError

    form = detect_format(rows[0][1], cfg) if rows else "native"
    if form == "native":
        return rows, form
    native = []
    for where, row in rows:
        try:
            native.append((where, to_native(row, form, cfg, pairs, chat_template)))
        except KeyError as e:
            raise DataError(f"{where}: {e.args[0]} (read as {form}, from the keys of its first row)") from None
    return native, form


def _string(row: dict, key: str, fmt: str, required: bool = True) -> str:
    value = row.get(key)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise KeyError(f"{fmt} rows need a string '{key}'" + (f", got {type(value).__name__}" if key in row else ""))
    return value


def _alpaca(row: dict, cfg: DataConfig, pairs: bool) -> dict:
    system = _string(row, cfg.system_key, "alpaca", required=False)
    messages = [{"role": "system", "content": system}] if system else []
    history = row.get(cfg.history_key) or []
    if not isinstance(history, list) or not all(
        isinstance(turn, list | tuple) and len(turn) == 2 and all(isinstance(t, str) for t in turn) for turn in history
    ):
        raise KeyError(f"alpaca '{cfg.history_key}' must be a list of [instruction, response] string pairs")
    for question, answer in history:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    query = [_string(row, cfg.instruction_key, "alpaca"), _string(row, cfg.input_key, "alpaca", required=False)]
    messages.append({"role": "user", "content": "\n".join(q for q in query if q)})
    if pairs:
        chosen, rejected = (_string(row, key, "alpaca ranking") for key in (cfg.chosen_key, cfg.rejected_key))
        return {cfg.prompt_key: messages, **_completions(chosen, rejected, cfg)}
    return {cfg.messages_key: messages + [{"role": "assistant", "content": _string(row, cfg.output_key, "alpaca")}]}


def _completions(chosen, rejected, cfg: DataConfig) -> dict:
    """The completions of a ranking row as a native pair's (under data.chosen_key and data.rejected_key)."""
    if not isinstance(chosen, dict):
        chosen, rejected = ({"role": "assistant", "content": c} for c in (chosen, rejected))
    return {cfg.chosen_key: [chosen], cfg.rejected_key: [rejected]}


def _sharegpt(row: dict, cfg: DataConfig, pairs: bool) -> dict:
    turns = row.get(cfg.conversations_key)
    if not isinstance(turns, list):
        raise KeyError(f"sharegpt '{cfg.conversations_key}' must be a list of {{{cfg.role_tag}, {cfg.content_tag}}}")
    turns = [_turn(t, cfg) for t in turns]
    system = _string(row, cfg.system_key, "sharegpt", required=False)
    if turns and turns[0][0] == cfg.system_tag:
        system, turns = turns[0][1], turns[1:]
    odd, even = (cfg.user_tag, cfg.observation_tag), (cfg.assistant_tag, cfg.function_tag)
    for i, (tag, _) in enumerate(turns):
        if tag not in (odd, even)[i % 2]:
            want = " or ".join(repr(t) for t in (odd, even)[i % 2])
            raise KeyError(f"sharegpt turn {i + 1} is from {tag!r}; turns alternate and this one must be from {want}")
    if pairs != (len(turns) % 2 == 1):
        need = "end on a user turn (the pair's completions follow)" if pairs else "end on an assistant turn"
        raise KeyError(f"sharegpt '{cfg.conversations_key}' must {need}; it has {len(turns)} turns")
    messages = ([{"role": "system", "content": system}] if system else []) + [_message(t, cfg) for t in turns]
    if not pairs:
        return {cfg.messages_key: messages}
    completions = []
    for key in (cfg.chosen_key, cfg.rejected_key):
        turn = _turn(row.get(key), cfg, f"sharegpt '{key}'")
        if turn[0] not in even:
            raise KeyError(f"sharegpt '{key}' must be from {cfg.assistant_tag!r} or {cfg.function_tag!r}")
        completions.append(_message(turn, cfg))
    return {cfg.prompt_key: messages, **_completions(*completions, cfg)}


def _turn(turn, cfg: DataConfig, what: str = "sharegpt turns") -> tuple[str, str]:
    if not isinstance(turn, dict) or not isinstance(turn.get(cfg.role_tag), str):
        raise KeyError(f"{what} need a string '{cfg.role_tag}' and '{cfg.content_tag}'")
    tag, content = turn[cfg.role_tag], turn.get(cfg.content_tag)
    if not isinstance(content, str):
        raise KeyError(f"{what} need a string '{cfg.role_tag}' and '{cfg.content_tag}'")
    known = (cfg.user_tag, cfg.assistant_tag, cfg.system_tag, cfg.function_tag, cfg.observation_tag)
    if tag not in known:
        raise KeyError(f"sharegpt role {tag!r} is none of {', '.join(repr(k) for k in known)} (data.*_tag)")
    return tag, content


def _message(turn: tuple[str, str], cfg: DataConfig) -> dict:
    """One ShareGPT turn as a chat message (a function call becomes an assistant message with `tool_calls`)."""
    tag, content = turn
    if tag == cfg.function_tag:
        try:
            calls = json.loads(content)
        except json.JSONDecodeError:
            raise KeyError(f"a '{cfg.function_tag}' turn must hold JSON ({{name, arguments}} or a list)") from None
        calls = calls if isinstance(calls, list) else [calls]
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c for c in calls):
            raise KeyError(f"a '{cfg.function_tag}' turn must hold {{name, arguments}} (or a list of them)")
        tool_calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
        return {"role": "assistant", "content": "", "tool_calls": tool_calls}
    role = {cfg.user_tag: "user", cfg.assistant_tag: "assistant", cfg.observation_tag: "tool"}.get(tag)
    if role is None:  # a system turn anywhere but first
        raise KeyError(f"sharegpt '{cfg.system_tag}' turns may only come first")
    return {"role": role, "content": content}
