"""Preference pairs -> token ids, exactly as TRL's `DPOTrainer` tokenizes them (trl 1.16, `_prepare_dataset` and
`DataCollatorForPreference`), so a pair scores the same tokens here as there.

Rows are `{"prompt", "chosen", "rejected"}` with strings, or conversational: `chosen` and `rejected` as message
lists, with a `prompt` message list or without one (the turns both share are the prompt, TRL's `extract_prompt`).

- Strings: each completion gets the tokenizer's EOS text appended (unless it already ends with it); the prompt and
  prompt + completion are tokenized with the tokenizer's own special-token handling.
- Conversations: the prompt through the chat template with the generation prompt, prompt + completion without.
- The completion starts where the tokenized prompt and prompt + completion stop agreeing (usually the prompt's
  end; TRL's `common_prefix_length`), the same cut for chosen and rejected.
- Each sequence is prompt + completion cut to `seq_length` from its start; the completion's tokens are its targets.
  A pair whose prompt alone fills `seq_length` has none and is left out, as TRL leaves it out.
"""

from __future__ import annotations

from data.chat import apply_template
from data.errors import DataError
from schema.data import SEQUENCES_PER_PAIR, DataConfig

PAIR_KEYS = ("chosen", "rejected")  # as many as SEQUENCES_PER_PAIR: the pair runs as its chosen, then its rejected
assert len(PAIR_KEYS) == SEQUENCES_PER_PAIR


def _conversational(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "role" in value[0]


def _check_messages(value, key: str) -> None:
    if not isinstance(value, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        raise KeyError(f"'{key}' must be a string or a list of {{role, content}} messages")


def extract_prompt(chosen, rejected):
    """TRL's `extract_prompt`: the leading turns (or characters) both completions share are the prompt."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):  # noqa: B007 - TRL keeps the loop's last index
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove the space before the completion (strings)
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def pair_fields(row: dict, cfg: DataConfig | None = None):
    """(prompt, chosen, rejected, conversational) of a pair row, its columns named by `data.prompt_key`,
    `data.chosen_key` and `data.rejected_key`; KeyError naming what is wrong.

    As TRL's `maybe_extract_prompt`: a prompt column of the completions' kind (both strings, both message lists) is
    the prompt; otherwise (no prompt column, or HuggingFaceH4/ultrafeedback_binarized's string prompt beside whole
    conversations) the leading turns both completions share are the prompt."""
    cfg = cfg or DataConfig()
    keys = {"prompt": cfg.prompt_key, "chosen": cfg.chosen_key, "rejected": cfg.rejected_key}
    missing = [keys[key] for key in PAIR_KEYS if keys[key] not in row]
    if missing:
        raise KeyError(
            f"preference rows need '{keys['chosen']}' and '{keys['rejected']}' (data.chosen_key, data.rejected_key); "
            f"this one has no '{missing[0]}'"
        )
    chosen, rejected = row[keys["chosen"]], row[keys["rejected"]]
    conversational = _conversational(chosen) or _conversational(rejected)
    for key in PAIR_KEYS:
        value = chosen if key == "chosen" else rejected
        if conversational:
            _check_messages(value, keys[key])
        elif not isinstance(value, str):
            raise KeyError(f"'{keys[key]}' must be a string or a list of {{role, content}} messages")
    prompt = row.get(keys["prompt"])
    if prompt is not None and not conversational and not isinstance(prompt, str):
        raise KeyError(f"'{keys['prompt']}' must be a string when the completions are strings")
    if prompt is None or _conversational(prompt) != conversational:  # the completions carry it: shared turns
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    elif conversational:
        _check_messages(prompt, keys["prompt"])
    return prompt, chosen, rejected, conversational


def common_prefix_length(ids, other) -> int:
    length = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        length += 1
    return length


def _chat_ids(prompt, chosen, rejected, tokenizer, kwargs: dict) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the prompt (with the generation prompt), prompt + chosen and prompt + rejected, each through
    the chat template once."""
    if not getattr(tokenizer, "chat_template", None):
        raise KeyError("conversational pairs need a tokenizer with a chat template (tokenizer_config.json)")

    def tokenize(messages, generation_prompt=False):
        out = apply_template(
            tokenizer,
            messages,
            "pair",
            tokenize=True,
            return_dict=True,
            add_generation_prompt=generation_prompt,
            **kwargs,
        )
        return list(out["input_ids"])

    return tokenize(prompt, generation_prompt=True), tokenize(prompt + chosen), tokenize(prompt + rejected)


def _string_texts(prompt: str, chosen: str, rejected: str, tokenizer) -> tuple[str, str, str]:
    """The prompt, prompt + chosen and prompt + rejected, each completion ended by EOS (TRL's string pairs)."""
    eos = tokenizer.eos_token or ""
    chosen = chosen if chosen.endswith(eos) else chosen + eos
    rejected = rejected if rejected.endswith(eos) else rejected + eos
    return prompt, prompt + chosen, prompt + rejected


def _split(prompt_ids, with_chosen, with_rejected) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) ids: the completions start where the prompt's tokens stop being a prefix."""
    cut = min(common_prefix_length(prompt_ids, with_chosen), common_prefix_length(prompt_ids, with_rejected))
    return list(prompt_ids[:cut]), list(with_chosen[cut:]), list(with_rejected[cut:])


def _parse(row, tokenizer, cfg: DataConfig):
    """A row as three id lists (conversational) or three texts still to tokenize (strings). KeyError: what is wrong."""
    if not isinstance(row, dict):
        raise KeyError("a preference row must be a JSON object")
    prompt, chosen, rejected, conversational = pair_fields(row, cfg)
    if conversational:
        return _chat_ids(prompt, chosen, rejected, tokenizer, dict(cfg.chat_template_kwargs or {}))
    return _string_texts(prompt, chosen, rejected, tokenizer)


def encode_pair(row: dict, tokenizer, cfg: DataConfig | None = None) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) of a pair row, as TRL's DPOTrainer tokenizes it."""
    parsed = _parse(row, tokenizer, cfg or DataConfig())
    if isinstance(parsed[0], str):
        parsed = [list(tokenizer(text)["input_ids"]) for text in parsed]
    return _split(*parsed)


def pair_sequences(prompt_ids, chosen_ids, rejected_ids, seq_length: int):
    """[(ids, targets) of prompt + chosen, the same of prompt + rejected], each cut to `seq_length` from its start;
    targets mark the completion's tokens. None when the prompt alone fills `seq_length`: no completion token would
    be left (TRL drops such pairs; the data report counts them as pairs without targets)."""
    if len(prompt_ids) >= seq_length:
        return None
    out = []
    for completion in (chosen_ids, rejected_ids):
        ids = (list(prompt_ids) + list(completion))[:seq_length]
        targets = ([False] * len(prompt_ids) + [True] * len(completion))[:seq_length]
        out.append((ids, targets))
    return out


def encode_pairs(rows, tokenizer, cfg: DataConfig | None = None) -> list[tuple[list[int], list[bool]]]:
    """Two (ids, targets) per (location, pair row): prompt + chosen, then prompt + rejected, not yet cut to a
    length (the store cuts every sequence from its start, `pair_sequences`' rule). The texts of string pairs go
    through the tokenizer in one batched call. DataError naming the row."""
    parsed = []
    for where, row in rows:
        try:
            parsed.append(_parse(row, tokenizer, cfg or DataConfig()))
        except KeyError as e:
            raise DataError(f"{where}: {e.args[0]}") from None
    texts = [text for triple in parsed if isinstance(triple[0], str) for text in triple]
    batched = iter(tokenizer(texts, return_attention_mask=False)["input_ids"] if texts else [])
    out = []
    for triple in parsed:
        if isinstance(triple[0], str):
            triple = (next(batched), next(batched), next(batched))
        prompt_ids, chosen_ids, rejected_ids = _split(*triple)
        for completion in (chosen_ids, rejected_ids):
            out.append((prompt_ids + completion, [False] * len(prompt_ids) + [True] * len(completion)))
    return out
