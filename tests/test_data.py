"""Data: tokenization rules, label shift, samplers, eval coverage, the loss on empty micro-batches."""

from __future__ import annotations

import json

import pytest
import torch

from data.collator import CausalLMCollator
from data.dataset import TokenizedDataset
from data.encode import encode_row
from data.errors import DataError
from data.packing import pack_rows
from data.sampling import TrainPlan, eval_indices
from data.sources import count_rows
from models.loss import IGNORE_INDEX, CausalLMLoss
from schema.data import DataConfig


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_prompt_response_targets_only_response_and_eos(tokenizer):
    ids, targets = encode_row({"prompt": "12+30=", "response": "42"}, tokenizer, DataConfig())
    prompt = tokenizer("12+30=")["input_ids"]
    response = tokenizer("42", add_special_tokens=False)["input_ids"]
    assert ids == prompt + response + [tokenizer.eos_token_id]
    assert targets == [False] * len(prompt) + [True] * (len(response) + 1)
    assert prompt[0] == tokenizer.bos_token_id  # the tokenizer's own BOS handling
    text_ids, text_targets = encode_row({"text": "the lazy dog"}, tokenizer, DataConfig())
    assert text_ids == tokenizer("the lazy dog")["input_ids"] and all(text_targets)


def test_collator_shifts_labels_and_pads(tokenizer):
    collate = CausalLMCollator(seq_length=8, pad_token_id=0)
    ids = torch.tensor([1, 5, 6, 7, 8])
    targets = torch.tensor([False, False, False, True, True])
    empty = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.bool))
    (input_ids, position_ids), labels, tokens = collate([(ids, targets), empty])
    assert input_ids.tolist() == [[1, 5, 6, 7, 8, 0, 0, 0], [0] * 8]
    assert position_ids.tolist() == [list(range(8))] * 2
    x = IGNORE_INDEX
    assert labels.tolist() == [[x, x, 7, 8, x, x, x, x], [x] * 8]  # labels[t] = target token at t + 1
    assert int(tokens) == 5  # tokens that are not padding


def test_packed_collator_restarts_positions_and_never_labels_across_rows():
    collate = CausalLMCollator(seq_length=10, pad_token_id=0, packing=True)
    a = (torch.tensor([1, 5, 6]), torch.tensor([False, True, True]))
    b = (torch.tensor([1, 7, 8, 9]), torch.tensor([False, False, True, True]))
    (input_ids, position_ids), labels, tokens = collate([[a, b], [b]])
    x = IGNORE_INDEX
    assert input_ids.tolist() == [[1, 5, 6, 1, 7, 8, 9, 0, 0, 0], [1, 7, 8, 9, 0, 0, 0, 0, 0, 0]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    # Row a's last token (6) does not predict row b's first (1); each row's targets stay its own.
    assert labels.tolist() == [[5, 6, x, x, 8, 9, x, x, x, x], [x, 8, 9, x, x, x, x, x, x, x]]
    assert int(tokens) == 11


def test_pack_rows_best_fit_is_deterministic_and_fits():
    lengths = [7, 3, 5, 2, 8, 1, 4, 6, 2, 2]
    order, starts = pack_rows(lengths, 10)
    bins = [order[starts[b] : starts[b + 1]].tolist() for b in range(len(starts) - 1)]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every row exactly once
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 4  # 40 tokens in 4 rows of 10: no room wasted
    assert bins == [[4, 3], [0, 1], [7, 6], [2, 8, 9, 5]]  # best fit: each row into the fullest row it fits
    with pytest.raises(ValueError, match="row 4 has 8 tokens, more than seq_length=7"):
        pack_rows(lengths, 7)


def test_truncation_and_bad_rows(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "the quick brown fox jumps over the lazy dog"}) + "\n\n")
    ds = TokenizedDataset(str(path), tokenizer, 4, DataConfig())
    assert len(ds) == 1 and len(ds[0][0]) == 4 and ds.report()["truncated_rows"] == 1
    assert count_rows(str(path)) == 1
    path.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not valid JSON"):
        TokenizedDataset(str(path), tokenizer, 8, DataConfig())
    path.write_text('{"question": "?"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: row has neither"):
        TokenizedDataset(str(path), tokenizer, 8, DataConfig())
    path.write_text("\n")
    with pytest.raises(DataError, match="empty dataset"):
        TokenizedDataset(str(path), tokenizer, 8, DataConfig())


@pytest.mark.parametrize("rows,dp,mbs,gas", [(100, 1, 2, 2), (100, 2, 3, 2), (101, 3, 2, 1), (64, 4, 4, 1)])
def test_train_plan_disjoint_cover_and_resume(rows, dp, mbs, gas):
    from torch.utils.data import DistributedSampler

    plan = TrainPlan(rows, dp, mbs, gas)
    for epoch in range(2):
        per_rank = [plan.epoch_indices(epoch, r, seed=3).tolist() for r in range(dp)]
        assert all(len(p) == plan.steps_per_epoch * mbs * gas for p in per_rank)
        for r in range(dp):  # the order DistributedSampler gives, kept as one tensor instead of a Python list
            sampler = DistributedSampler(range(rows), num_replicas=dp, rank=r, shuffle=True, seed=3, drop_last=True)
            sampler.set_epoch(epoch)
            assert per_rank[r] == list(sampler)[: len(per_rank[r])]
        flat = [i for p in per_rank for i in p]
        assert len(set(flat)) == len(flat)  # disjoint across DP ranks
        assert rows - len(flat) < dp * mbs * gas  # together they cover all but a partial step
        # Resuming at any step of the epoch continues with exactly the rows not yet consumed.
        for skip in range(plan.steps_per_epoch):
            assert plan.epoch_indices(epoch, 0, 3, skip).tolist() == per_rank[0][skip * mbs * gas :]
    assert plan.epoch_indices(0, 0, 3).tolist() != plan.epoch_indices(1, 0, 3).tolist()  # reshuffled per epoch
    assert plan.position(plan.steps_per_epoch + 1) == (1, 1)


@pytest.mark.parametrize("rows,dp,mbs,mb", [(37, 2, 3, 2), (5, 4, 1, 1), (1, 2, 4, 3), (64, 4, 4, 4)])
def test_eval_sees_every_row_exactly_once(rows, dp, mbs, mb):
    per_rank = [eval_indices(rows, dp, r, mbs, mb).tolist() for r in range(dp)]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) % (mbs * mb) == 0
    assert sorted(i for p in per_rank for i in p if i != -1) == list(range(rows))


def test_loss_ignored_micro_batch_is_zero_and_scale_gives_global_mean():
    loss_fn = CausalLMLoss()
    logits = torch.randn(2, 5, 11, requires_grad=True)
    empty = torch.full((2, 5), IGNORE_INDEX)
    out = loss_fn(logits, (empty, torch.tensor(3.0)))
    out.backward()
    assert out.item() == 0.0 and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0
    # Two micro-batches with 1 and 7 target tokens: scaled losses averaged like DeepSpeed does
    # (divide by micro-batches) equal the mean over all 8 tokens, not the mean of the two means.
    labels = [torch.full((1, 4), IGNORE_INDEX), torch.randint(0, 11, (1, 7))]
    labels[0][0, 2] = 4
    logits = [torch.randn(1, 4, 11), torch.randn(1, 7, 11)]
    scale = torch.tensor(2 / 8)
    ours = sum(CausalLMLoss()(lg, (lb, scale)) for lg, lb in zip(logits, labels)) / 2
    every = torch.cat(
        [
            torch.nn.functional.cross_entropy(lg[0], lb[0], reduction="none", ignore_index=IGNORE_INDEX)
            for lg, lb in zip(logits, labels)
        ]
    )
    torch.testing.assert_close(ours, every[torch.cat([lb[0] for lb in labels]) != IGNORE_INDEX].mean())


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-2's: the system prompt folded into the first [INST], each answer followed by " </s>".
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% if loop.first and system %}{% set text = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + m['content'] %}"
    "{% else %}{% set text = m['content'] %}{% endif %}{{ bos_token + '[INST] ' + text + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Llama-3's: header tokens around each role, every turn ended by <|eot_id|>.
LLAMA3 = (
    "{{ bos_token or '' }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "llama3": LLAMA3}
# template -> (text before an answer's content inside its span, text after it): what the targets must be.
ANSWER_SPANS = {"chatml": ("", "<|im_end|>\n"), "llama2": (" ", " {eos}"), "llama3": ("", "<|eot_id|>")}
CONVERSATION = [
    {"role": "system", "content": "add numbers"},
    {"role": "user", "content": "12+30="},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "5+8= and\nthen?"},
    {"role": "assistant", "content": "13, then 99+1=100"},
]


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_chat_tokens_equal_inference_tokens_and_targets_are_the_answers(kind, template, chat_tokenizers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizers[kind])
    tok.chat_template = TEMPLATES[template]
    ids, targets = encode_row({"messages": CONVERSATION}, tok, DataConfig())
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    # The tokens trained on are the tokens inference produces for the same conversation.
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)["input_ids"])
    # Targets: exactly each answer's content and end-of-turn marker, token boundaries on the span edges.
    before, after = ANSWER_SPANS[template]
    after = after.format(eos=tok.eos_token)
    spans, cursor = [], 0
    for m in CONVERSATION:
        if m["role"] == "assistant":
            start = text.index(before + m["content"] + after, cursor)
            spans.append((start, start + len(before + m["content"] + after)))
            cursor = spans[-1][1]
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    for start, end in spans:
        inside = [o for o, t in zip(offsets, targets, strict=True) if t and start <= o[0] < end]
        assert inside and inside[0][0] == start and inside[-1][1] == end, (text[start:end], inside)
        assert all(a[1] == b[0] for a, b in zip(inside, inside[1:]) if a[1] != a[0]), inside  # contiguous
    expected = [any(s <= o[0] and o[1] <= e for s, e in spans) for o in offsets]
    assert targets == expected
    assert sum(targets) < len(targets) / 2  # headers, system and user turns are context


def test_chat_rows_errors(tokenizer_dir, chat_tokenizers, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizers["bpe"])
    tok.chat_template = CHATML
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tok.save_pretrained(tmp_path / "tok")
    ds = TokenizedDataset(str(path), AutoTokenizer.from_pretrained(tmp_path / "tok"), 256, DataConfig())
    assert ds[0][1].tolist() == encode_row({"messages": CONVERSATION}, tok, DataConfig())[1]
    for bad, msg in [
        ([{"role": "user", "content": "hi"}], "no assistant turn"),
        ([{"role": "user"}], "string 'role' and a string 'content'"),
        ("hello", "non-empty list"),
    ]:
        path.write_text(json.dumps({"messages": bad}) + "\n")
        with pytest.raises(DataError, match=rf"chat.jsonl:1: .*{msg}"):
            TokenizedDataset(str(path), tok, 64, DataConfig())
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(DataError, match="chat.jsonl:1: rows with 'messages' need a tokenizer with a chat template"):
        TokenizedDataset(str(path), AutoTokenizer.from_pretrained(tokenizer_dir), 64, DataConfig())


def write_formats(rows: list[dict], tmp_path) -> dict[str, str]:
    """The same rows as JSONL, JSON, Parquet and a datasets directory."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = {fmt: str(tmp_path / f"rows.{fmt}") for fmt in ("jsonl", "json", "parquet")}
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with open(paths["json"], "w") as f:
        json.dump(rows, f)
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    paths["datasets"] = str(tmp_path / "rows_ds")
    datasets.Dataset.from_list(rows).save_to_disk(paths["datasets"])
    return paths


def test_every_format_gives_the_same_samples(tokenizer, tmp_path):
    rows = [{"prompt": f"{a}+{a}=", "response": str(2 * a)} for a in range(12)]
    paths = write_formats(rows, tmp_path)
    samples = {}
    for fmt, path in paths.items():
        assert count_rows(path) == 12, fmt
        ds = TokenizedDataset(path, tokenizer, 16, DataConfig())
        samples[fmt] = [(ids.tolist(), t.tolist()) for ids, t in (ds[i] for i in range(len(ds)))]
    assert samples["json"] == samples["jsonl"] == samples["parquet"] == samples["datasets"]
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"dd: a DatasetDict; name one split's directory \(e.g. .*dd/train\)"):
        TokenizedDataset(str(tmp_path / "dd"), tokenizer, 16, DataConfig())
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="rows.csv: unknown data format"):
        count_rows(str(tmp_path / "rows.csv"))
    assert len(TokenizedDataset([paths["jsonl"], paths["parquet"]], tokenizer, 16, DataConfig())) == 24


def test_byte_order_marks_nulls_and_ambiguous_rows(tokenizer, tmp_path):
    """A UTF-8 BOM (Windows tools) is read; a key set to null is absent (Parquet files that mix row kinds
    have every column in every row); a row of two kinds is refused naming its line."""
    rows = [{"text": "the quick brown fox"}, {"prompt": "1+1=", "response": "2"}]
    plain = write_formats(rows, tmp_path)
    expected = [(ids.tolist(), t.tolist()) for ids, t in TokenizedDataset(plain["jsonl"], tokenizer, 16, DataConfig())]
    for fmt in ("jsonl", "json"):
        bom = tmp_path / f"bom.{fmt}"
        bom.write_bytes(b"\xef\xbb\xbf" + open(plain[fmt], "rb").read())
        got = [(ids.tolist(), t.tolist()) for ids, t in TokenizedDataset(str(bom), tokenizer, 16, DataConfig())]
        assert got == expected, fmt
    nulls = tmp_path / "nulls"
    nulls.mkdir()
    full = write_formats([{k: r.get(k) for k in ("text", "prompt", "response")} for r in rows], nulls)
    for fmt, path in full.items():  # every column in every row: null where a row has no such key
        got = [(ids.tolist(), t.tolist()) for ids, t in TokenizedDataset(path, tokenizer, 16, DataConfig())]
        assert got == expected, fmt
    path = tmp_path / "both.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b", "messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(DataError, match=r"both.jsonl:2: row has both 'messages' and 'text'"):
        TokenizedDataset(str(path), tokenizer, 16, DataConfig())


def test_weighted_mixture_keeps_total_and_repeats_evenly(tokenizer, tmp_path):
    from data.sources import mixture_index

    picks = mixture_index([30, 10], [1.0, 3.0], seed=5)
    assert len(picks) == 40 and int((picks < 30).sum()) == 10 and len(set(picks[picks < 30].tolist())) == 10
    from_b = picks[picks >= 30] - 30
    assert sorted(from_b.tolist()) == sorted(list(range(10)) * 3)  # each row of the small source exactly 3 times
    assert all(sorted(from_b[k * 10 : (k + 1) * 10].tolist()) == list(range(10)) for k in range(3))  # no early repeat
    assert (mixture_index([30, 10], [1.0, 3.0], seed=5) == picks).all()
    assert not (mixture_index([30, 10], [1.0, 3.0], seed=6) == picks).all()
    assert mixture_index([3, 2], None, 0) is None  # the sources concatenated
    with pytest.raises(DataError, match="one weight >= 0 per train file"):
        mixture_index([3, 2], [1.0], 0)


@pytest.mark.slow
def test_trainer_mixes_parquet_and_datasets_dir(converted, tmp_path):
    """train_file=[a.parquet, b_dataset_dir] with data.train_weights=[1,3]: 40 rows, 30 of them from b."""
    import sys

    from tests.conftest import run_cmd

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_formats([{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(30)], tmp_path / "a")
    b = write_formats([{"prompt": f"{i}+2=", "response": str(i + 2)} for i in range(10)], tmp_path / "b")
    out = tmp_path / "run"
    args = [
        f"model_name_or_path={converted['gqa']}",
        f"output_dir={out}",
        "seq_length=16",
        "micro_batch_size=4",
        "max_steps=2",
        "deepspeed=fp32",
        f"train_file=[{a['parquet']},{b['datasets']}]",
        "data.train_weights=[1,3]",
    ]
    proc = run_cmd([sys.executable, "trainer.py", *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.load(open(out / "data_report.json"))["train"]
    assert report["rows"] == 40 and report["rows_without_targets"] == 0
    assert not (out / "eval_results.json").exists()  # no eval_file given and do_eval unset: no evaluation
    from tests.catalogue import config_error  # the trainer's own checks, in-process (one launch per kind)

    assert "data.train_weights has 1 entries for 2 train files" in config_error([*args[:-1], "data.train_weights=[1]"])
