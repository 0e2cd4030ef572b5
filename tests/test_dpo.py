"""Preference tuning through the trainer (`objective=dpo`): the pipeline's evaluation against TRL's, training
against a single-process reference, the reference pass cached and reused, resume, LoRA."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import check, deepspeed_launch
from tests.test_data import CHATML
from tests.test_preference import CHAT_PAIRS, IMPLICIT_PROMPT_PAIRS, STRING_PAIRS, tiny_pair_models

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

SEQ = 128  # the sentencepiece chat prompts fit (at 64 they fill it)


def arithmetic_pairs(n: int, chat: bool, seed: int) -> list[dict]:
    """`n` pairs of sums: the right answer chosen, a wrong one rejected (strings, or conversations)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, good, bad = f"{a}+{b}=", str(a + b), str(a + b + rng.choice([-10, -1, 1, 10]))
        if chat:
            rows.append({"prompt": [{"role": "user", "content": prompt}],
                         "chosen": [{"role": "assistant", "content": good}],
                         "rejected": [{"role": "assistant", "content": bad}]})  # fmt: skip
        else:
            rows.append({"prompt": prompt, "chosen": " " + good, "rejected": " " + bad})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def dpo_models(chat_tokenizers, tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{tokenizer kind: (policy HF directory, reference HF directory)}: two differently initialised tiny LLaMAs,
    each saved with its tokenizer (a ChatML template, pad = EOS)."""
    from transformers import AutoTokenizer

    root, out = tmp_path_factory.mktemp("dpo_models"), {}
    for kind, tok_dir in chat_tokenizers.items():
        tok = AutoTokenizer.from_pretrained(tok_dir)
        tok.chat_template = CHATML
        tok.pad_token = tok.pad_token or tok.eos_token
        dirs = []
        for name, model in zip(("policy", "reference"), tiny_pair_models(tok), strict=True):
            path = root / f"{kind}_{name}"
            model.save_pretrained(path)
            tok.save_pretrained(path)
            dirs.append(str(path))
        out[kind] = tuple(dirs)
    return out


def dpo_args(policy: str, out, **extra) -> list[str]:
    args = {"model_name_or_path": policy, "output_dir": str(out), "objective": "dpo", "seq_length": SEQ,
            "micro_batch_size": 2, "gradient_accumulation_steps": 2, "deepspeed": "fp32", "num_stages": 2,
            "model.attn_implementation": "sdpa", **extra}  # fmt: skip
    return [f"{k}={v}" for k, v in args.items()]


EVAL_GROUPS = {"strings": STRING_PAIRS, "chat": CHAT_PAIRS, "chat-implicit-prompt": IMPLICIT_PROMPT_PAIRS}


def combined(per_group: list[tuple[int, dict]]) -> dict:
    """Means over every pair from per-group means weighted by their pair counts."""
    total = sum(n for n, _ in per_group)
    keys = per_group[0][1].keys()
    return {"pairs": total, **{k: sum(n * m[k] for n, m in per_group) / total for k in keys if k != "pairs"}}


@pytest.mark.parametrize("kind", ["sentencepiece", "bpe"])
def test_pipeline_evaluation_equals_trl(kind, dpo_models, tmp_path):
    """PP=2, evaluation only, a reference model (an HF directory) that differs from the policy, string pairs and
    conversational pairs (with and without a shared prompt) in one eval set: the trainer's eval_results.json
    equals `DPOTrainer.evaluate()` over the same pairs for sigmoid and ipo (per format, weighted by pairs): loss 1e-5
    relative, the same pairs ranked right, the other reward means 1e-4. TRL's DPOTrainer has no SimPO: its
    evaluation equals TRL's CPO SimPO loss on the HF policy (tests/test_preference.py proves our SimPO equals
    `CPOTrainer.cpo_loss`). The reference pass runs once: the ipo launch reuses the sigmoid launch's log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.preference import PreferenceSettings
    from tests.test_preference import our_evaluation, trl_evaluation

    policy_dir, reference_dir = dpo_models[kind]
    files = [write_jsonl(tmp_path / f"{name}.jsonl", rows) for name, rows in EVAL_GROUPS.items()]
    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy, reference = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
                         for d in (policy_dir, reference_dir))  # fmt: skip
    cache = tmp_path / "cache"
    for settings in (PreferenceSettings("sigmoid", beta=0.2), PreferenceSettings("ipo", beta=0.1),
                     PreferenceSettings("simpo", beta=2.0, gamma=0.4)):  # fmt: skip
        out = tmp_path / settings.loss_type
        dpo = {"reference_model": reference_dir, "loss_type": settings.loss_type, "beta": settings.beta,
               "gamma": settings.gamma, "sft_weight": settings.sft_weight}  # fmt: skip
        extra = {"data.cache_dir": cache, **{f"dpo.{k}": v for k, v in dpo.items()}}
        args = dpo_args(policy_dir, out, do_train="false", eval_file="[" + ",".join(files) + "]", **extra)
        proc = check(deepspeed_launch(2, *args))
        ran_reference = "reference log-probs of 7 pairs computed" in proc.stderr
        assert ran_reference == (settings.loss_type == "sigmoid"), proc.stderr[-3000:]
        ours = json.loads((out / "eval_results.json").read_text())
        if settings.loss_type == "simpo":
            groups = [our_evaluation(policy, reference, tok, rows, settings, SEQ) for rows in EVAL_GROUPS.values()]
        else:
            groups = [trl_evaluation(policy, reference, tok, rows, settings, tmp_path, SEQ)
                      for rows in EVAL_GROUPS.values()]  # fmt: skip
        theirs = combined([(g["pairs"], g) for g in groups])
        print(f"{kind}/{settings.loss_type}: ours {ours}\n  reference {theirs}")
        assert ours["eval_pairs"] == theirs["pairs"] == 7
        assert ours["eval_loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        correct = ours["eval_rewards/accuracies"] * 7  # the same pairs ranked right (TRL's means are float32)
        assert correct == round(correct) == round(theirs["rewards/accuracies"] * 7)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert ours[f"eval_{key}"] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key
