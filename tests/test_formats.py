"""LLaMA-Factory's alpaca and ShareGPT files (data/formats.py): each row gives exactly the tokens and targets of the
same conversation written as `messages` (or as a conversational pair), on both tokenizer kinds through real chat
templates; the format is detected per file and reported; bad rows are one line naming file and line."""

from __future__ import annotations

import json

import pytest

from data.dataset import TokenizedDataset
from data.errors import DataError
from data.pair_dataset import PairDataset
from schema.data import DataConfig
from tests.test_data import CHATML, LLAMA3

# A ChatML template with tools in Qwen2.5's layout: a tool call is the assistant's <tool_call> JSON, a tool's answer
# a <tool_response> inside a user turn.
TOOLS_CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n"
    "{% for c in m['tool_calls'] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ALPACA = [
    {"instruction": "Add the numbers.", "input": "12+30", "output": "42", "system": "You are a calculator."},
    {"instruction": "And now?", "input": "", "output": "99", "history": [["Add 1 and 1.", "2"], ["Double it.", "4"]]},
    {"instruction": "the quick brown fox", "output": "jumps over the lazy dog"},
]
ALPACA_AS_MESSAGES = [
    [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "Add the numbers.\n12+30"},
        {"role": "assistant", "content": "42"},
    ],
    [
        {"role": "user", "content": "Add 1 and 1."},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "Double it."},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": "99"},
    ],
    [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps over the lazy dog"}],
]
CALL = {"name": "add", "arguments": {"a": 12, "b": 30}}
SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "You are a calculator."},
            {"from": "human", "value": "12+30="},
            {"from": "function_call", "value": json.dumps(CALL)},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "It is 42."},
        ]
    },
    {"conversations": [{"from": "human", "value": "the quick brown fox"}, {"from": "gpt", "value": "jumps"}]},
]
SHAREGPT_AS_MESSAGES = [
    [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "12+30="},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "It is 42."},
    ],
    [{"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps"}],
]


def tokenizer(chat_tokenizers, kind: str, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizers[kind])
    tok.chat_template = template
    return tok


def samples(ds) -> list:
    return [tuple(t.tolist() for t in ds[i]) for i in range(len(ds))]


def write(path, rows, jsonl: bool = True) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) if jsonl else json.dumps(rows))
    return str(path)


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
@pytest.mark.parametrize("fmt", ["alpaca", "sharegpt"])
def test_rows_equal_the_same_conversations_written_as_messages(fmt, kind, chat_tokenizers, tmp_path):
    rows, conversations = (ALPACA, ALPACA_AS_MESSAGES) if fmt == "alpaca" else (SHAREGPT, SHAREGPT_AS_MESSAGES)
    tok = tokenizer(chat_tokenizers, kind, TOOLS_CHATML)
    source = write(tmp_path / f"{fmt}.json", rows, jsonl=False)  # LLaMA-Factory's files are JSON arrays
    native = write(tmp_path / "messages.jsonl", [{"messages": m} for m in conversations])
    ours = TokenizedDataset(source, tok, 1024, DataConfig(), cache_dir=str(tmp_path / "cache"))
    expected = TokenizedDataset(native, tok, 1024, DataConfig(), cache_dir=str(tmp_path / "cache"))
    assert samples(ours) == samples(expected) and len(ours) == len(rows)
    assert all(any(targets) for _, targets in samples(ours))
    assert ours.report()["formats"] == {source: fmt} and expected.report()["formats"] == {native: "native"}
    if fmt == "sharegpt":  # the tool call is a target, the tool's answer is not
        ids, targets = ours[0]
        text = tok.decode([i for i, t in zip(ids.tolist(), targets.tolist(), strict=True) if t])
        assert '"name": "add"' in text and "It is 42." in text and "You are a calculator" not in text


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_ranking_rows_equal_conversational_pairs(kind, chat_tokenizers, tmp_path):
    tok = tokenizer(chat_tokenizers, kind, CHATML)
    sharegpt = [
        {
            "conversations": [{"from": "human", "value": "12+30="}],
            "chosen": {"from": "gpt", "value": "42"},
            "rejected": {"from": "gpt", "value": "43"},
        }
    ]
    alpaca = [{"instruction": "Add.", "input": "12+30", "chosen": "42", "rejected": "43", "system": "Be exact."}]
    pairs = [
        {
            "prompt": [{"role": "user", "content": "12+30="}],
            "chosen": [{"role": "assistant", "content": "42"}],
            "rejected": [{"role": "assistant", "content": "43"}],
        },
        {
            "prompt": [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Add.\n12+30"}],
            "chosen": [{"role": "assistant", "content": "42"}],
            "rejected": [{"role": "assistant", "content": "43"}],
        },
    ]
    cache = str(tmp_path / "cache")
    for i, (name, rows) in enumerate((("sharegpt", sharegpt), ("alpaca", alpaca))):
        ours = PairDataset(write(tmp_path / f"{name}.jsonl", rows), tok, 512, DataConfig(), cache_dir=cache)
        theirs = PairDataset(write(tmp_path / f"pairs{i}.jsonl", [pairs[i]]), tok, 512, DataConfig(), cache_dir=cache)
        assert samples(ours) == samples(theirs) and len(ours) == 1
        assert list(ours.report()["formats"].values()) == [name]


def test_remapped_columns_and_roles_and_a_forced_format(chat_tokenizers, tmp_path):
    tok = tokenizer(chat_tokenizers, "bpe", LLAMA3)
    renamed = [
        {
            "turns": [
                {"role": "user", "content": t["value"]}
                if t["from"] == "human"
                else {"role": "assistant", "content": t["value"]}
                for t in SHAREGPT[1]["conversations"]
            ]
        }
    ]
    cfg = DataConfig(
        conversations_key="turns", role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant"
    )
    ours = TokenizedDataset(write(tmp_path / "renamed.jsonl", renamed), tok, 64, cfg, cache_dir=str(tmp_path / "c"))
    expected = TokenizedDataset(
        write(tmp_path / "m.jsonl", [{"messages": SHAREGPT_AS_MESSAGES[1]}]), tok, 64, DataConfig(), cache_dir=None
    )
    assert samples(ours) == samples(expected)
    # data.format forces a reading: a native prompt/response file read as alpaca has no 'instruction'.
    forced = DataConfig(format="alpaca")
    path = write(tmp_path / "native.jsonl", [{"prompt": "1+1=", "response": "2"}])
    with pytest.raises(DataError, match=r"native.jsonl:1: alpaca rows need a string 'instruction' \(read as alpaca"):
        TokenizedDataset(path, tok, 64, forced, cache_dir=str(tmp_path / "c"))


def test_bad_rows_are_one_line_naming_file_and_line(chat_tokenizers, tmp_path):
    tok = tokenizer(chat_tokenizers, "bpe", CHATML)  # a template without tools
    cases = [
        (SHAREGPT[:1], "sharegpt.jsonl:1: the tokenizer's chat template has no tool calls"),
        (
            [SHAREGPT[1], {"conversations": [{"from": "gpt", "value": "hi"}]}],
            "sharegpt.jsonl:2: sharegpt turn 1 is from 'gpt'; turns alternate and this one must be from 'human' or "
            "'observation' (read as sharegpt",
        ),
        ([{"conversations": [{"from": "human", "value": "hi"}]}], "must end on an assistant turn; it has 1 turns"),
        ([{"conversations": [{"from": "bot", "value": "hi"}]}], "sharegpt role 'bot' is none of"),
        ([{"instruction": "x", "output": 3}], "alpaca.jsonl:1: alpaca rows need a string 'output', got int"),
        ([{"instruction": "x", "output": "y", "history": ["a"]}], "alpaca 'history' must be a list of"),
    ]
    for i, (rows, fragment) in enumerate(cases):
        name = "alpaca.jsonl" if "instruction" in rows[0] else "sharegpt.jsonl"
        path = tmp_path / str(i)
        path.mkdir()
        with pytest.raises(DataError) as e:
            TokenizedDataset(write(path / name, rows), tok, 64, DataConfig(), cache_dir=str(path / "cache"))
        assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)
        assert not [n for n in (path / "cache").iterdir() if not n.name.endswith(".lock")]  # nothing half-built
