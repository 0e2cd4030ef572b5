"""Multi-turn chat rows under the real chat templates of Qwen3, Qwen3.5, Llama 3, Gemma 3, gpt-oss and DeepSeek-V3
(as TRL ships them, byte for byte the models' own: trl/chat_templates/), against a reference that reads each
rendering's own structure: the tokens are one rendering of the whole conversation, the targets every assistant turn
after its header, through its end-of-turn marker."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from data.chat import configure_chat_template
from data.encode import encode_row
from data.errors import DataError
from schema.data import DataConfig

QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
LLAMA3 = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
GEMMA = ["<bos>", "<start_of_turn>", "<end_of_turn>"]
DEEPSEEK = ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"]
DEEPSEEK += [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
]
BOS = {"llama3": "<|begin_of_text|>", "gemma3": "<bos>", "deepseekv3": "<｜begin▁of▁sentence｜>"}


def trl_template(name: str) -> str:
    return resources.files("trl").joinpath("chat_templates", f"{name}.jinja").read_text()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with every template's markers as added tokens (so offsets cover every character)."""
    from tools.tiny_models import SAMPLE_TEXTS, make_bpe_tokenizer

    root = tmp_path_factory.mktemp("chat_templates")
    specials = QWEN_SPECIALS + HARMONY + LLAMA3 + GEMMA + DEEPSEEK
    return make_bpe_tokenizer(str(root / "bpe"), SAMPLE_TEXTS * 20, vocab_size=400, special_tokens=specials)


def tokenizer_for(tokenizer_dir: str, template: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = trl_template(template)
    if template in BOS:
        tok.bos_token = BOS[template]
    return tok


SYSTEM = {"role": "system", "content": "You add numbers."}


def conversation(reasoning: str) -> list[dict]:
    """Three user turns, three answers; with `reasoning`: each answer's thinking as `reasoning_content` ('field'),
    inline in `<think>` ('inline'), as gpt-oss's `thinking` ('thinking'), or none ('none')."""
    answers = [("12+30 is 42.", "42"), ("5+8 is 13.", "13, then 99+1=100"), ("Just 7.", "7")]
    messages = [SYSTEM]
    for i, (thought, answer) in enumerate(answers):
        messages.append({"role": "user", "content": ["12+30=", "5+8= and\nthen?", "3+4?"][i]})
        turn = {"role": "assistant", "content": answer}
        if reasoning == "field":
            turn["reasoning_content"] = thought
        elif reasoning == "inline":
            turn["content"] = f"<think>\n{thought}\n</think>\n\n{answer}"
        elif reasoning == "thinking":
            turn["thinking"] = thought
        messages.append(turn)
    return messages


def tool_turns(arguments) -> list[dict]:
    """A tool call (its arguments as the template takes them: a JSON string for DeepSeek, a mapping for Qwen3.5),
    the tool's answer, and the final answer."""
    call = {"type": "function", "function": {"name": "add", "arguments": arguments}}
    return [
        SYSTEM,
        {"role": "user", "content": "What is 2+2? Use the tool."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "It is 4."},
    ]


def _spans(text: str, header: str, end: str, generation_prompt: str | None = None) -> list[tuple[int, int]]:
    """Every `header`...`end` (end included); the generation prompt's longer header where the rendering has it."""
    spans, cursor = [], 0
    while (at := text.find(header, cursor)) >= 0:
        start = at + len(header)
        if generation_prompt and text.startswith(generation_prompt, at):
            start = at + len(generation_prompt)
        stop = text.index(end, start) + len(end)
        spans.append((start, stop))
        cursor = stop
    return spans


def harmony_spans(text: str) -> list[tuple[int, int]]:
    """gpt-oss: an assistant turn is one or more harmony messages `<|start|>assistant...` ended by `<|end|>`,
    `<|return|>` or `<|call|>`; the turn starts after the first one's `<|start|>assistant` (the generation prompt),
    and the headers of its later messages are the model's to write."""
    spans = []
    for m in re.finditer(r"<\|start\|>assistant(.*?)(<\|end\|>|<\|return\|>|<\|call\|>)", text, re.S):
        if spans and spans[-1][1] == m.start():
            spans[-1] = (spans[-1][0], m.end())
        else:
            spans.append((m.start() + len("<|start|>assistant"), m.end()))
    return spans


def reference_spans(template: str, text: str, kwargs: dict) -> list[tuple[int, int]]:
    if template.startswith("qwen3"):
        think_off = kwargs.get("enable_thinking") is False or (
            template == "qwen3_5_nothink" and kwargs.get("enable_thinking") is not True
        )
        # The generation prompt where the rendering has it whole: Qwen3's and Qwen3.5's empty think block with
        # thinking off, Qwen3.5's open one with thinking on (the model goes on inside it).
        prompt = "<|im_start|>assistant\n<think>\n" + ("\n</think>\n\n" if think_off else "")
        if template == "qwen3" and not think_off:
            prompt = None
        return _spans(text, "<|im_start|>assistant\n", "<|im_end|>\n", prompt)
    if template == "llama3_2":
        return _spans(text, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>")
    if template == "gemma3":
        return _spans(text, "<start_of_turn>model\n", "<end_of_turn>\n")
    if template == "gptoss":
        return harmony_spans(text)
    if template == "deepseekv3":  # an answer after tool outputs has no header of its own
        found = re.finditer(r"(<｜Assistant｜>|<｜tool▁outputs▁end｜>)(.*?<｜end▁of▁sentence｜>)", text, re.S)
        return [m.span(2) for m in found]
    raise AssertionError(template)


def check_against_reference(tok, template: str, messages: list[dict], cfg: DataConfig) -> tuple[str, list]:
    """encode_row's ids are the one rendering's tokens; its targets are the reference spans' tokens."""
    ids, targets = encode_row({"messages": messages}, tok, cfg)
    text = tok.apply_chat_template(messages, tokenize=False, **cfg.chat_template_kwargs)
    encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert ids == encoded["input_ids"]
    spans = reference_spans(template, text, cfg.chat_template_kwargs)
    if cfg.train_on == "last_assistant_turn":
        spans = spans[-1:]
    expected = [any(s < end and e > b for b, end in spans) for s, e in encoded["offset_mapping"]]
    assert targets == expected, [text[b:e] for b, e in spans]
    return text, spans


CASES = [
    ("qwen3", "field", {}),
    ("qwen3", "inline", {}),
    ("qwen3", "field", {"enable_thinking": False}),
    ("qwen3_5_think", "field", {}),
    ("qwen3_5_nothink", "inline", {}),
    ("qwen3_5_think", "inline", {"enable_thinking": False}),
    ("llama3_2", "none", {}),
    ("gemma3", "none", {}),
    ("gptoss", "thinking", {}),
    ("deepseekv3", "inline", {}),
]


@pytest.mark.parametrize("template,reasoning,kwargs", CASES)
@pytest.mark.parametrize("train_on", ["all_assistant_turns", "last_assistant_turn"])
def test_multi_turn_rows_under_real_templates_match_the_rendering_structure(
    template, reasoning, kwargs, train_on, tokenizer_dir
):
    tok = tokenizer_for(tokenizer_dir, template)
    cfg = DataConfig(train_on=train_on, chat_template_kwargs=kwargs)
    messages = conversation(reasoning)
    text, spans = check_against_reference(tok, template, messages, cfg)
    assert len(spans) == (3 if train_on == "all_assistant_turns" else 1)
    final = text[spans[-1][0] : spans[-1][1]]
    assert "7" in final and "3+4" not in final  # the last answer, not its question
    if template.startswith("qwen3") and reasoning != "none" and not kwargs:
        # Qwen3 drops the reasoning of turns before the last query: only the last answer thinks, as at inference.
        assert "Just 7." in final and "12+30 is 42." not in text


def test_the_old_prefix_rule_refused_qwen3_and_gpt_oss(tokenizer_dir):
    """The control: Qwen3's and gpt-oss's renderings of a conversation's start are not prefixes of the whole."""
    for template, reasoning in (("qwen3", "field"), ("gptoss", "thinking")):
        tok = tokenizer_for(tokenizer_dir, template)
        messages = conversation(reasoning)
        upto = tok.apply_chat_template(messages[:3], tokenize=False)
        assert not tok.apply_chat_template(messages, tokenize=False).startswith(upto)


@pytest.mark.parametrize("template", ["qwen3", "qwen3_5_think", "deepseekv3"])
def test_tool_call_turns_are_targets(template, tokenizer_dir):
    tok = tokenizer_for(tokenizer_dir, template)
    arguments = '{"a": 2, "b": 2}' if template == "deepseekv3" else {"a": 2, "b": 2}
    text, spans = check_against_reference(tok, template, tool_turns(arguments), DataConfig())
    assert len(spans) == 2 and "add" in text[spans[0][0] : spans[0][1]]


@pytest.mark.parametrize("template", ["qwen3", "llama3", "gemma3", "gptoss"])
def test_generation_blocks_give_the_spans_the_rendering_rule_finds(template, tokenizer_dir):
    """TRL's training variants mark assistant output with {% generation %}: those spans (transformers' assistant
    mask) are used as they are, and equal what the locating rule finds in the same rendering."""
    from data import chat

    tok = tokenizer_for(tokenizer_dir, template)
    tok.chat_template = trl_template(f"{template}_training")
    messages = conversation("thinking" if template == "gptoss" else "none")
    ids, targets = encode_row({"messages": messages}, tok, DataConfig())
    masked = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(masked["input_ids"])
    # transformers' own mask covers a token when the span's first or last character is in it; ours, on overlap.
    assert [bool(m) for m in masked["assistant_masks"]] == targets
    text, spans = chat.chat_spans(messages, tok, DataConfig())
    # TRL's gpt-oss variant puts each turn's `<|start|>assistant`, the generation prompt, inside its block.
    prompt = "<|start|>assistant" if template == "gptoss" else ""
    spans = [(s + len(prompt) if text.startswith(prompt, s) else s, e) for s, e in spans]
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    original = chat._GENERATION_BLOCK
    chat._GENERATION_BLOCK = re.compile("(?!)")  # the locating rule on the same template
    try:
        assert encode_row({"messages": messages}, tok, DataConfig()) == (ids, chat.targets_from_spans(offsets, spans))
    finally:
        chat._GENERATION_BLOCK = original
    assert sum(targets) > 0


def test_chat_template_setting_and_errors(tokenizer_dir, tmp_path):
    tok = tokenizer_for(tokenizer_dir, "qwen3")
    path = tmp_path / "t.jinja"
    path.write_text(trl_template("gemma3"))
    configure_chat_template(tok, DataConfig(chat_template=str(path)))
    assert tok.chat_template == trl_template("gemma3")
    configure_chat_template(tok, DataConfig(chat_template=trl_template("llama3_2")))
    assert tok.chat_template == trl_template("llama3_2")
    with pytest.raises(ValueError, match="data.chat_template=nowhere.jinja: neither a file nor a Jinja template"):
        configure_chat_template(tok, DataConfig(chat_template="nowhere.jinja"))
    tok.chat_template = trl_template("gemma3")  # alternation enforced by the template itself: one line
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(KeyError, match="refused this conversation: Conversation roles must alternate"):
        encode_row({"messages": bad}, tok, DataConfig())


def test_store_names_follow_the_chat_settings(tokenizer_dir, tmp_path):
    from data.dataset import TokenizedDataset
    from data.store import store_key

    tok = tokenizer_for(tokenizer_dir, "qwen3")
    path = tmp_path / "chat.jsonl"
    import json

    path.write_text(json.dumps({"messages": conversation("field")}) + "\n")
    names = {
        store_key(str(path), tok, DataConfig(**kw), 64, False)[0]
        for kw in ({}, {"train_on": "last_assistant_turn"}, {"chat_template_kwargs": {"enable_thinking": False}})
    }
    assert len(names) == 3
    ds = TokenizedDataset(str(path), tok, 512, DataConfig(train_on="last_assistant_turn"))
    ids, targets = encode_row({"messages": conversation("field")}, tok, DataConfig(train_on="last_assistant_turn"))
    assert ds[0][0].tolist() == ids and ds[0][1].tolist() == targets
    with pytest.raises(DataError, match="chat.jsonl:1: .*no assistant turn"):
        path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
        TokenizedDataset(str(path), tok, 64, DataConfig())


def reference_eval(hf_dir: str, tok, template: str, rows: list[list[dict]], cfg: DataConfig) -> tuple[float, int]:
    """transformers' model over the rendering of each row, targets from the rendering's own structure: (mean loss
    over target tokens, their count)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for messages in rows:
        text = tok.apply_chat_template(messages, tokenize=False, **cfg.chat_template_kwargs)
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = reference_spans(template, text, cfg.chat_template_kwargs)
        spans = spans[-1:] if cfg.train_on == "last_assistant_turn" else spans
        ids = torch.tensor(encoded["input_ids"])
        targets = torch.tensor([any(s < end and e > b for b, end in spans) for s, e in encoded["offset_mapping"]])
        labels = torch.where(targets, ids, -100)[1:]
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum"))
        count += int((labels != -100).sum())
    return total / count, count


@pytest.mark.slow
def test_trainer_eval_of_multi_turn_rows_equals_the_reference(tokenizer_dir, tmp_path):
    """Qwen3's real template from the checkpoint's tokenizer_config.json, then Qwen3.5's given as
    data.chat_template with thinking off and only the last turn trained, then Llama 3.2's, Gemma 3's, gpt-oss's and
    DeepSeek-V3's: the trainer's evaluation (PP=2) over multi-turn rows with reasoning and tool calls equals
    transformers' loss on the reference's target tokens."""
    import json

    from tests.conftest import check, launch
    from tools.tiny_models import make_hf_model, tiny_config

    tok = tokenizer_for(tokenizer_dir, "qwen3")
    hf_dir = str(tmp_path / "qwen3")
    config = tiny_config("qwen3", vocab_size=len(tok), max_position_embeddings=512)
    make_hf_model(hf_dir, config, tokenizer_dir=tokenizer_dir)
    tok.save_pretrained(hf_dir)  # with Qwen3's chat template
    rows = [conversation("field"), conversation("inline"), tool_turns({"a": 2, "b": 2}), conversation("none")[:3]]
    cases = [
        ("qwen3", rows, DataConfig(), []),
        (
            "qwen3_5_think",
            rows,
            DataConfig(train_on="last_assistant_turn", chat_template_kwargs={"enable_thinking": False}),
            ["data.train_on=last_assistant_turn", "+data.chat_template_kwargs.enable_thinking=false"],
        ),
        # the other templates, each given as data.chat_template over rows of the kind it renders
        ("llama3_2", [conversation("none"), conversation("none")[:3]], DataConfig(), []),
        ("gemma3", [conversation("none"), conversation("none")[:3]], DataConfig(), []),
        ("gptoss", [conversation("thinking"), conversation("none")[:5]], DataConfig(), []),
        ("deepseekv3", [conversation("inline"), tool_turns('{"a": 2}')], DataConfig(), []),
    ]
    for name, chats, cfg, extra in cases:
        out = tmp_path / f"eval-{name}"
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
        template = tmp_path / f"{name}.jinja"
        template.write_text(trl_template(name))
        args = [f"model_name_or_path={hf_dir}", f"output_dir={out}", f"eval_file={data}", "do_train=false"]
        args += ["seq_length=512", "micro_batch_size=1", "deepspeed=fp32", "num_stages=2", "data.cache_dir=''"]
        args += [] if name == "qwen3" else [f"data.chat_template={template}"]  # qwen3: the checkpoint's own
        if name in BOS:  # the template's BOS as the model's tokenizer would name it
            args.append(f"tokenizer_name_or_path={bos_tokenizer(tokenizer_dir, name, tmp_path)}")
        check(launch(2, *args, *extra))
        results = json.load(open(out / "eval_results.json"))
        ref_tok = tokenizer_for(tokenizer_dir, name)
        loss, count = reference_eval(hf_dir, ref_tok, name, chats, cfg)
        assert results["eval_tokens"] == count
        assert results["eval_loss"] == pytest.approx(loss, rel=1e-4)


def bos_tokenizer(tokenizer_dir: str, template: str, tmp_path) -> str:
    """The test tokenizer saved with `template`'s BOS token (Llama 3's, Gemma 3's, DeepSeek's)."""
    out = str(tmp_path / f"tok-{template}")
    tokenizer_for(tokenizer_dir, template).save_pretrained(out)
    return out


@pytest.mark.parametrize("template", ["llama3_2", "gemma3", "qwen3"])
def test_the_prefix_shortcut_finds_what_the_locating_rule_finds(template, tokenizer_dir):
    """Where a template renders the conversation up to a turn as a prefix of the whole, two renderings give the turn's
    span (`_prefix_span`); the locating rule (five) gives the same span there."""
    from data import chat

    tok = tokenizer_for(tokenizer_dir, template)
    messages = conversation("field" if template == "qwen3" else "none")
    text = tok.apply_chat_template(messages, tokenize=False)

    def render(turns, generation_prompt=False):
        return tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt) if turns else ""

    found = 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and (span := chat._prefix_span(i, messages, text, render)) is not None:
            assert chat._locate(i, messages, text, render) == span
            found += 1
    # Qwen3: its last turn only (an earlier one ending a shorter conversation gets a <think> block the whole lacks)
    assert found >= (1 if template == "qwen3" else 3)
