"""Chat rows -> token ids and target masks under any chat template, exactly as inference tokenizes them.

The tokens are one rendering of the whole conversation (`apply_chat_template(messages)`, what inference sees at the
last turn), tokenized once. The targets are every assistant turn's text as it stands in that rendering: what the
model writes after the generation prompt (the turn's header excluded; reasoning, tool calls and the end-of-turn
marker included). Templates need not render a conversation's start as a prefix of the whole (Qwen3's and Qwen3.5's
drop the `<think>` blocks of turns before the last user query and give the last turn one; gpt-oss ends the last turn
with `<|return|>`, the others with `<|end|>`), so each turn is found in the one rendering, not in renderings of
prefixes:

- Templates with `{% generation %}` blocks mark their spans themselves (transformers' assistant-mask tracker).
- Others: a turn starts where the rendering of the conversation before it, with the generation prompt, stops
  agreeing with the whole (the generation prompt is context: Qwen3's empty `<think>` block with thinking off is not a
  target). Its content ends where the rendering of the whole stops agreeing with the same rendering in which only
  this turn's content is marked (a character appended). After the content comes what the template writes after it
  when the turn ends the conversation (tool calls, the end marker), as far as the whole agrees with it; where it
  departs inside a token (gpt-oss's `<|end|>` for `<|return|>`) that token still ends the turn.

A token is a target when its characters (the tokenizer's offsets) overlap a turn's span.
"""

from __future__ import annotations

import re

from schema.data import DataConfig, TrainOn

# Appended to one turn's content to find where the template writes it: not whitespace (templates trim), not a
# character that chat text or a template's own markup uses.
MARK = "\u2063"
_GENERATION_BLOCK = re.compile(r"{%-?\s*generation\s*-?%}")


def apply_template(tokenizer, messages, what: str, **kwargs):
    """`tokenizer.apply_chat_template(messages, **kwargs)`; KeyError in one line when the template refuses `what`."""
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, or what the template itself raises
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise KeyError(f"the tokenizer's chat template refused this {what}: {reason}") from None


def configure_chat_template(tokenizer, cfg: DataConfig):
    """Give `tokenizer` the chat template `data.chat_template` names (a Jinja file or the template itself), if set.
    ValueError (one line, naming the key) when it is neither. Returns the tokenizer."""
    import os

    value = cfg.chat_template
    if not value:
        return tokenizer
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    elif "{{" in value or "{%" in value:
        tokenizer.chat_template = value
    else:
        raise ValueError(f"data.chat_template={value}: neither a file nor a Jinja template")
    return tokenizer


def chat_spans(messages: list[dict], tokenizer, cfg: DataConfig) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, [start, end) character spans of its targets). KeyError: what is wrong."""
    if not getattr(tokenizer, "chat_template", None):
        raise KeyError("rows with 'messages' need a tokenizer with a chat template (tokenizer_config.json)")
    kwargs = dict(cfg.chat_template_kwargs or {})

    def render(turns, generation_prompt=False) -> str:
        if not turns:
            return ""
        return apply_template(
            tokenizer, turns, "conversation", tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise KeyError("conversation has no assistant turn to learn from")
    text = render(messages)
    if _GENERATION_BLOCK.search(tokenizer.get_chat_template()):
        spans = _generation_spans(messages, tokenizer, kwargs, text)
        if cfg.train_on == TrainOn.last_assistant_turn:  # the blocks from the last turn's start on
            start = _common_prefix(text, render(messages[: turns[-1]], generation_prompt=True))
            spans = [(s, e) for s, e in spans if s >= start]
    else:
        if cfg.train_on == TrainOn.last_assistant_turn:
            turns = turns[-1:]
        spans = [_prefix_span(i, messages, text, render) or _locate(i, messages, text, render) for i in turns]
        spans = [span for span in spans if span is not None]
    if not spans:
        raise KeyError("the chat template renders no assistant turn of this conversation: nothing to learn from")
    return text, spans


def _generation_spans(messages, tokenizer, kwargs: dict, text: str) -> list[tuple[int, int]]:
    """The character spans of the template's `{% generation %}` blocks (what `return_assistant_tokens_mask` marks)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(
            conversations=[messages],
            chat_template=tokenizer.get_chat_template(),
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **{**tokenizer.special_tokens_map, **kwargs},
        )
    except Exception as e:  # noqa: BLE001 - as apply_template
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise KeyError(f"the tokenizer's chat template refused this conversation: {reason}") from None
    assert rendered[0] == text, "the generation-block rendering differs from apply_chat_template's"
    return [(s, e) for s, e in indices[0] if e > s]


def _prefix_span(i: int, messages: list[dict], text: str, render) -> tuple[int, int] | None:
    """[start, end) of assistant turn `i` where the template renders the conversation up to it as a prefix of the
    whole (ChatML's, Llama 3's, Gemma's): the same span `_locate` finds, in two renderings instead of five. None
    where it does not."""
    context, upto = render(messages[:i], generation_prompt=True), render(messages[: i + 1])
    if len(upto) > len(context) and upto.startswith(context) and text.startswith(upto):
        return len(context), len(upto)
    return None


def _locate(i: int, messages: list[dict], text: str, render) -> tuple[int, int] | None:
    """[start, end) of assistant turn `i` in `text`, the whole conversation's rendering; None when the template
    does not render the turn. KeyError when the rendering of what comes before it is not where the whole has it."""
    marked = _marked(messages, i)
    if marked is None:
        return None
    content_end = _common_prefix(text, render(marked))
    if content_end == len(text):  # marking the turn changed nothing: the template leaves it out
        return None
    before = render(messages[:i], generation_prompt=True)
    start = _common_prefix(text, before)
    if start < len(before):  # the generation prompt is not all there: the turn starts after its role header
        start = min(start, _role_header_end(messages[:i], before, text, render))
    previous = _marked(messages, i - 1) if i > 0 else None
    floor = _common_prefix(text, render(previous)) if previous is not None else 0
    floor = 0 if floor == len(text) else floor  # the template leaves the message before out (or folds it in)
    if not floor <= start <= content_end:
        raise KeyError(
            f"the chat template renders the conversation before assistant turn {i} otherwise than the whole "
            "conversation does: its targets cannot be placed; set data.chat_template to a template with "
            "{% generation %} blocks"
        )
    upto, upto_marked = render(messages[: i + 1]), render(_marked(messages[: i + 1], i))
    tail = upto[_common_prefix(upto, upto_marked) :]  # after the content when the turn ends the conversation
    agree = _common_prefix(text[content_end:], tail)
    end = content_end + agree
    if 0 < agree < len(tail):  # the whole ends the turn otherwise: the token this departure falls in ends it
        end = -(content_end + agree + 1)  # resolved against the token offsets (see targets_from_spans)
    return start, end


def _role_header_end(context: list[dict], before: str, text: str, render) -> int:
    """Where the turn after `context` starts in `text` when `text` departs from the generation prompt partway (Qwen3
    with thinking off gives a last turn with reasoning its own `<think>` block, not the prompt's empty one): after
    the part of the generation prompt that an answer's header shares (the header a plain answer gets in the middle
    of a conversation). Without that structure: len(text), so the caller keeps where the prompt stops agreeing."""
    rendered = render(context)
    if not (text.startswith(rendered) and before.startswith(rendered)):
        return len(text)
    try:
        probe = render([*context, {"role": "assistant", "content": MARK}, {"role": "user", "content": "."}])
    except KeyError:  # the template refuses the probe conversation
        return len(text)
    at = probe.find(MARK, len(rendered))
    if not probe.startswith(rendered) or at < 0:
        return len(text)
    return len(rendered) + _common_prefix(before[len(rendered) :], probe[len(rendered) : at])


def _marked(messages: list[dict], i: int) -> list[dict] | None:
    """`messages` with turn i marked: MARK after its content, or (when the template may not render the content of
    a turn with tool calls, gpt-oss's) after its last tool call's name. None: nothing to mark."""
    message = dict(messages[i])
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls and not message.get("content"):
        call = dict(calls[-1])
        function = call.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            call["function"] = {**function, "name": function["name"] + MARK}
        elif isinstance(call.get("name"), str):
            call["name"] = call["name"] + MARK
        else:
            return None
        message["tool_calls"] = [*calls[:-1], call]
    else:
        message["content"] = (message.get("content") or "") + MARK
    return [*messages[:i], message, *messages[i + 1 :]]


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # binary search on equal prefixes (renderings run to tens of thousands of characters)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def targets_from_spans(offsets, spans: list[tuple[int, int]]) -> list[bool]:
    """Per token (its character offsets): is it a target? A token overlapping a span is one; a span ending at -(p+1)
    runs to the end of the token holding character p (a zero-width token counts where its position falls)."""
    resolved = []
    for start, end in spans:
        if end < 0:
            at = -end - 1
            end = max((e for s, e in offsets if s <= at < e), default=at + 1)
        resolved.append((start, end))

    def is_target(start: int, end: int) -> bool:
        if start == end:
            return any(s <= start < e for s, e in resolved)
        return any(start < e and end > s for s, e in resolved)

    return [is_target(start, end) for start, end in offsets]
