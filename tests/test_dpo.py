"""Preference tuning through the trainer (`objective=dpo`): the pipeline's evaluation against TRL's, training
against a single-process reference, the reference pass cached and reused, resume, LoRA."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models.families import family_of, resolve_attention
from schema.train import DpoConfig, OptimConfig, TrainConfig
from tests.baseline import train_dpo_reference
from tests.catalogue import Catalogue, Inputs, run_args, run_case, trainer_cmd
from tests.conftest import LAUNCHER, check, free_port, launch, read_jsonl
from tests.test_data import CHATML
from tests.test_preference import CHAT_PAIRS, IMPLICIT_PROMPT_PAIRS, STRING_PAIRS, tiny_pair_models
from tools.tiny_models import tiny_config

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

BAD_PAIRS = Catalogue()  # bad pair files through the trainer (tests/catalogue.py: what each case must show)
case = BAD_PAIRS.case

SEQ = 128  # the sentencepiece chat prompts fit (at 64 they fill it)
CP_SEQ = 48  # context parallelism: the conversational completions (byte-level BPE) cross the middle of the row


def arithmetic_pairs(n: int, chat: bool, seed: int) -> list[dict]:
    """`n` pairs of sums: the right answer chosen, a wrong one rejected (strings, or conversations)."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, good, bad = f"{a}+{b}=", str(a + b), str(a + b + rng.choice([-10, -1, 1, 10]))
        if chat:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                }
            )
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
    args = {
        "model_name_or_path": policy,
        "output_dir": str(out),
        "objective": "dpo",
        "seq_length": SEQ,
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "deepspeed": "fp32",
        "num_stages": 2,
        "model.attn_implementation": "sdpa",
        **extra,
    }
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
    `CPOTrainer.cpo_loss`). The reference pass runs once: the ipo launch reuses the sigmoid launch's log-probs. With
    the BPE tokenizer, sigmoid alone (the other losses differ in formula only, proven with sentencepiece)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.preference import PreferenceSettings
    from tests.test_preference import our_evaluation, trl_evaluation

    policy_dir, reference_dir = dpo_models[kind]
    files = [write_jsonl(tmp_path / f"{name}.jsonl", rows) for name, rows in EVAL_GROUPS.items()]
    tok = AutoTokenizer.from_pretrained(policy_dir)
    policy, reference = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
        for d in (policy_dir, reference_dir)
    )
    cache = tmp_path / "cache"
    losses = [
        PreferenceSettings("sigmoid", beta=0.2),
        PreferenceSettings("ipo", beta=0.1),
        PreferenceSettings("simpo", beta=2.0, gamma=0.4),
    ]
    # The byte-level BPE tokenizer changes the rows' tokens, not the losses' formulas: sigmoid alone there.
    for settings in losses if kind == "sentencepiece" else losses[:1]:
        out = tmp_path / settings.loss_type
        dpo = {
            "reference_model": reference_dir,
            "loss_type": settings.loss_type,
            "beta": settings.beta,
            "gamma": settings.gamma,
            "sft_weight": settings.sft_weight,
        }
        extra = {"data.cache_dir": cache, **{f"dpo.{k}": v for k, v in dpo.items()}}
        args = dpo_args(policy_dir, out, do_train="false", eval_file="[" + ",".join(files) + "]", **extra)
        proc = check(launch(2, *args))
        ran_reference = "reference log-probs of 7 pairs computed" in proc.stderr
        assert ran_reference == (settings.loss_type == "sigmoid"), proc.stderr[-3000:]
        ours = json.loads((out / "eval_results.json").read_text())
        if settings.loss_type == "simpo":
            groups = [our_evaluation(policy, reference, tok, rows, settings, SEQ) for rows in EVAL_GROUPS.values()]
        else:
            groups = [
                trl_evaluation(policy, reference, tok, rows, settings, tmp_path, SEQ) for rows in EVAL_GROUPS.values()
            ]
        theirs = combined([(g["pairs"], g) for g in groups])
        print(f"{kind}/{settings.loss_type}: ours {ours}\n  reference {theirs}")
        assert ours["eval_pairs"] == theirs["pairs"] == 7
        assert ours["eval_loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        correct = ours["eval_rewards/accuracies"] * 7  # the same pairs ranked right (TRL's means are float32)
        assert correct == round(correct) == round(theirs["rewards/accuracies"] * 7)
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert ours[f"eval_{key}"] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), key


def train_config(train_files: list[str], **dpo) -> TrainConfig:
    """The parity runs' settings (clipping at 0.05 is active on these steps, so a wrong grad norm would show)."""
    return TrainConfig(
        train_file=train_files,
        seq_length=SEQ,
        micro_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=4,
        learning_rate=3e-3,
        seed=7,
        objective="dpo",
        dpo=DpoConfig(**dpo),
        optim=OptimConfig(weight_decay=0.1, max_grad_norm=0.05, warmup_steps=1, lr_scheduler="cosine"),
    )


def launch_args(cfg: TrainConfig, policy: str, out, stages: int, **extra) -> list[str]:
    d, o = cfg.dpo, cfg.optim
    args = {
        "train_file": "[" + ",".join(cfg.train_file) + "]",
        "max_steps": cfg.max_steps,
        "seed": cfg.seed,
        "learning_rate": cfg.learning_rate,
        "optim.weight_decay": o.weight_decay,
        "optim.max_grad_norm": o.max_grad_norm,
        "optim.warmup_steps": o.warmup_steps,
        "dpo.loss_type": d.loss_type,
        "dpo.beta": d.beta,
        "dpo.sft_weight": d.sft_weight,
        "seq_length": cfg.seq_length,
        **extra,
    }
    if d.reference_model:
        args["dpo.reference_model"] = d.reference_model
    return dpo_args(policy, out, num_stages=stages, **args)


@pytest.fixture(scope="module")
def train_pairs(tmp_path_factory) -> list[str]:
    """40 training pairs in two files: 24 string pairs and 16 conversational ones."""
    root = tmp_path_factory.mktemp("dpo_train")
    return [
        write_jsonl(root / "strings.jsonl", arithmetic_pairs(24, False, 0)),
        write_jsonl(root / "chat.jsonl", arithmetic_pairs(16, True, 1)),
    ]


def assert_matches_dpo_reference(
    out, cfg: TrainConfig, policy_dir: str, reference_dir: str, dp: int, weights: float | None = None, cp: int = 1
):
    """The run in `out` against `train_dpo_reference`: losses (1e-5), grad norms (1e-4), reward margins and the
    trained weights (or, with LoRA, the adapters) within `weights` absolute (default 1% of lr, the SFT parity bound,
    with rtol 1e-5). Under CP (`cp` ranks), the negative control too: some sequence crosses the shard boundary, and
    without the sum over the ranks the first loss would differ. Returns (the worst weight gap, the trained model)."""
    from transformers import AutoConfig

    from checkpoint.pipeline_reader import load_hf_state_dict
    from tests.baseline import hub_state_dict
    from tests.test_lora import adapter_state

    split = cfg.seq_length // cp if cp > 1 else 0
    model, losses, norms, margins, control = train_dpo_reference(policy_dir, reference_dir, cfg, dp, split)
    if control:  # without the CP sum of the log-probs, the second loss would be off by far more than its bound
        unsummed, crossing = control
        print(
            f"DPO under CP: {crossing} sequences cross position {split}; without the CP sum the second loss would "
            f"be {unsummed:.6g} instead of {losses[1]:.6g} ({abs(unsummed - losses[1]):.3g} apart)"
        )
        assert crossing > 0 and abs(unsummed - losses[1]) > 100 * 1e-5 * abs(losses[1]), (control, losses[1])
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, cfg.max_steps + 1))
    assert all(m["pairs"] == cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp for m in metrics)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics]), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(norms), rtol=1e-4, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor([m["rewards/margins"] for m in metrics]), torch.tensor(margins), rtol=1e-4, atol=1e-6
    )
    assert all(n > cfg.optim.max_grad_norm for n in norms), "clipping should be active in this test"
    config = AutoConfig.from_pretrained(out)
    if cfg.lora.enabled:
        ours = adapter_state(out, config)
        ref = {f"base_model.model.{k}": v for k, v in model.state_dict().items() if ".lora_" in k}
    else:
        ours, ref = load_hf_state_dict(str(out), config), hub_state_dict(model)
    assert set(ours) == set(ref)
    worst = 0.0
    for key, value in ref.items():
        atol, rtol = (weights, 0.0) if weights else (0.01 * cfg.learning_rate, 1e-5)
        torch.testing.assert_close(ours[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")
        worst = max(worst, float((ours[key] - value).abs().max()))
    return worst, model


# (stages, TP, dpo settings, reference: a model of its own (else the starting weights), LoRA, trainer overrides)
DPO_LAYOUTS = {
    "pp2-dp2-sigmoid-sft": (2, 1, {"loss_type": "sigmoid", "beta": 0.1, "sft_weight": 0.3}, True, False, {}),
    "pp2-tp2-ipo-chunked-recompute": (
        2,
        2,
        {"loss_type": "ipo", "beta": 0.1},
        False,
        False,
        {"model.loss_chunk_size": 7, "model.activation_checkpointing": "true"},
    ),
    "pp2-dp2-lora-sigmoid": (2, 1, {"loss_type": "sigmoid", "beta": 0.1}, False, True, {}),
    # Context parallelism: each sequence's 48 positions split over 2 ranks at position 24, where the conversational
    # pairs' completions (positions 21-26) and some eval pairs' cross it; log-probs summed over the ranks, in chunks.
    "pp2-cp2-sigmoid-sft-chunked": (
        2,
        1,
        {"loss_type": "sigmoid", "beta": 0.1, "sft_weight": 0.3},
        True,
        False,
        {"context_parallel_size": 2, "model.loss_chunk_size": 5, "seq_length": CP_SEQ},
    ),
}


@pytest.mark.parametrize("layout", list(DPO_LAYOUTS))
def test_dpo_training_matches_single_process_reference(layout, dpo_models, train_pairs, tmp_path):
    """4 ranks, 4 AdamW steps with clipping active, string and conversational pairs: losses, grad norms, reward
    margins and weights (with LoRA: adapters, against PEFT on the HF model) equal the single-process reference
    trained with TRL's loss; under TP=2 through the vocab-parallel path, in chunks, with recompute. The first layout
    also resumes from its step-2 checkpoint with the cached reference log-probs removed: the reference pass runs
    again (with the reference weights, not the resumed policy's) and the run continues bit-identically."""
    from tests.resumes import assert_resumed_exactly, interrupted_copy

    stages, tp, dpo, distinct, lora, extra = DPO_LAYOUTS[layout]
    policy, reference = dpo_models["bpe"]
    cfg = train_config(train_pairs, reference_model=reference if distinct else None, **dpo)
    extra = dict(extra)
    cfg.seq_length = extra.pop("seq_length", SEQ)
    if lora:
        from tests.test_lora import LORA, lora_overrides

        cfg.lora = LORA
        cfg.optim.max_grad_norm = 0.02  # adapters start at B = 0: smaller gradients
        extra = {**extra, **dict(o.split("=", 1) for o in lora_overrides())}
    out, first = tmp_path / "run", layout == "pp2-dp2-sigmoid-sft"
    evaluated = first or "cp2" in layout
    if evaluated:
        # An evaluation at the end of 7 pairs in 3 files over the DP ranks (padded to 8 on each); the first layout
        # also trains on a weighted mixture of the two files (pairs repeated and left out; the reference pass scores
        # the stores in their order).
        files = [write_jsonl(tmp_path / f"eval_{name}.jsonl", rows) for name, rows in EVAL_GROUPS.items()]
        extra = {**extra, "eval_file": "[" + ",".join(files) + "]", "eval_micro_batch_size": 1}
    if first:
        cfg.data.train_weights = [1.5, 0.5]
        extra["data.train_weights"] = "[1.5,0.5]"
    proc = check(launch(4, *launch_args(cfg, policy, out, stages, tensor_parallel_size=tp, save_steps=2, **extra)))
    assert "reference log-probs of 40 pairs computed" in proc.stderr
    ref_dir = reference if distinct else policy
    cp = int(extra.get("context_parallel_size", 1))
    dp = 4 // (stages * tp * cp)
    # measured 8.2e-7 (LoRA) to 2.27e-6 over the four layouts: held at 1.5e-5 (Mixtral's keep 1% of lr: 1.15e-5)
    worst, model = assert_matches_dpo_reference(out, cfg, policy, ref_dir, dp=dp, weights=1.5e-5, cp=cp)
    print(f"DPO training parity ({layout}): max |weight diff| after {cfg.max_steps} steps = {worst:.3g}")
    report = json.loads((out / "data_report.json").read_text())["train"]
    assert report["pairs"] == 40 and report["pairs_without_targets"] == 0 and report["truncated_pairs"] == 0
    if not evaluated:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.preference import PreferenceSettings
    from tests.test_preference import our_evaluation

    rows = [r for group in EVAL_GROUPS.values() for r in group]
    hf_reference = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation="sdpa")
    expected = our_evaluation(
        model.eval(),
        hf_reference,
        AutoTokenizer.from_pretrained(policy),
        rows,
        PreferenceSettings.of(cfg.dpo),
        cfg.seq_length,
    )
    got = json.loads((out / "eval_results.json").read_text())
    assert got["step"] == 4 and got["eval_pairs"] == expected["pairs"] == 7
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        assert got[f"eval_{key}"] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    if not first:
        return
    part = tmp_path / "resumed"
    interrupted_copy(out, part, 2)
    for cached in (part / "data_cache" / "reference_logps").iterdir():
        cached.unlink()
    args = launch_args(cfg, policy, part, stages, save_steps=2, resume="true", **{"data.train_weights": "[1.5,0.5]"})
    proc = check(launch(4, *args))
    assert (
        "reference log-probs of 40 pairs computed" in proc.stderr and f"resumed from {part}/global_step2" in proc.stderr
    )
    assert_resumed_exactly(out, part, 2)


@pytest.mark.parametrize(
    "family, ep, cp",
    [("mixtral", 1, 1), ("mixtral", 2, 1), ("mixtral", 1, 2)]
    + [
        (family, 2, 1)
        for family in ("deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_next", "mistral4", "qwen3_5_moe_text")
    ],
)
def test_dpo_with_experts_matches_single_process_reference(family, ep, cp, chat_tokenizers, train_pairs, tmp_path):
    """A Mixtral policy (4 experts, top-2), PP=2 x DP=2 (with EP=2: 2 experts per rank, for the reference pass as
    for training; with CP=2: PP=2 x CP=2, each sequence's positions on 2 ranks), its starting weights as the
    reference: the reference pass and 4 AdamW steps with clipping equal the single-process reference (no
    load-balancing loss: the model config's output_router_logits is false, as in the hub's Mixtral and Qwen-MoE
    configs). With EP=2 in bf16 too: the same losses and grad norms to bf16 precision. DeepSeek-V3 (latent
    attention, its dense first layer on stage 0, the sigmoid router with score biases) and gpt-oss (sinks, biased
    experts and router), GLM-4.5, Qwen3-Next (linear attention, the gated shared expert), Mistral 4 (latent
    attention, the softmax router) and Qwen3.5-MoE (from transformers' one-key-per-expert save) at PP=2 x DP=2 x EP=2
    the same way."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_tokenizers["bpe"])
    tok.chat_template = CHATML
    tok.pad_token = tok.pad_token or tok.eos_token
    # Qwen3-Next, Qwen3.5-MoE: one layer of each kind, one per stage (two linear-attention layers alone have no cache
    # length for transformers' forward to read).
    hybrid = family in ("qwen3_next", "qwen3_5_moe_text")
    kinds = {"layer_types": ["linear_attention", "full_attention"]} if hybrid else {}
    # (Qwen3.5's tokenizer class, which transformers picks for its model type, adds a token: rows to spare)
    vocab = len(tok) + (8 if family == "qwen3_5_moe_text" else 0)
    config = tiny_config(
        family, vocab_size=vocab, num_hidden_layers=2, pad_token_id=None, eos_token_id=tok.eos_token_id, **kinds
    )
    torch.manual_seed(0)
    policy = tmp_path / "policy"
    AutoModelForCausalLM.from_config(config).save_pretrained(policy)
    tok.save_pretrained(policy)
    cfg = train_config(train_pairs, loss_type="sigmoid", beta=0.1)
    cfg.seq_length = CP_SEQ if cp > 1 else SEQ
    out = tmp_path / "run"
    attn = {"model.attn_implementation": resolve_attention(config, None)}  # SDPA, or eager (gpt-oss's sinks)
    proc = check(
        launch(4, *launch_args(cfg, str(policy), out, 2, expert_parallel_size=ep, context_parallel_size=cp, **attn))
    )
    assert "reference log-probs of 40 pairs computed" in proc.stderr
    # Weights held at ~10x the figure under CP (2.22e-6); at EP=1/2 at 1% of lr (measured 1.15e-5, docs/measured.md).
    weights = 2e-5 if cp > 1 else None
    worst, _ = assert_matches_dpo_reference(out, cfg, str(policy), str(policy), dp=2 // cp, weights=weights, cp=cp)
    if family_of(config).moe.aux_loss:  # reported, not trained on
        assert all(m["aux_loss"] > 0 for m in read_jsonl(out / "metrics.jsonl"))
    layout = f"PP=2 x DP={2 // cp} x EP={ep}" + (f" x CP={cp}" if cp > 1 else "")
    print(f"DPO training parity ({family}, {layout}): max |weight diff| after 4 steps = {worst:.3g}")
    if (
        ep == 2 and family == "mixtral"
    ):  # the GPU default (bf16: DeepSpeed's bf16 optimizer reducing the experts), to bf16 precision
        bf16 = tmp_path / "bf16"
        check(launch(4, *launch_args(cfg, str(policy), bf16, 2, expert_parallel_size=ep, deepspeed="bf16_zero1")))
        a, b = (read_jsonl(d / "metrics.jsonl") for d in (out, bf16))
        assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=3e-3)
        assert [m["grad_norm"] for m in b] == pytest.approx([m["grad_norm"] for m in a], rel=1.5e-2)


def test_dpo_under_each_pipeline_schedule_equals_1f1b(dpo_models, train_pairs, tmp_path):
    """zero_bubble (deferred weight gradients) and dualpipev (the loss on rank 0, two stages per rank) train DPO as
    1F1B does: the same losses, grad norms and reward margins (1e-6) and final weights (1e-6), 4 decoder layers,
    PP=2, 4 micro-batches a step; each schedule's reference pass gives the same log-probs (1e-6)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.test_faults import final_weights
    from tools.tiny_models import tiny_config

    tok = AutoTokenizer.from_pretrained(dpo_models["bpe"][0])
    config = tiny_config(
        vocab_size=len(tok),
        num_hidden_layers=4,
        pad_token_id=None,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    policy = tmp_path / "policy4"
    LlamaForCausalLM(config).save_pretrained(policy)
    tok.save_pretrained(policy)
    cfg = train_config(train_pairs, loss_type="sigmoid", beta=0.1)
    cfg.max_steps = 2
    runs = {}
    for schedule in ("1f1b", "zero_bubble", "dualpipev"):
        out = tmp_path / schedule
        args = launch_args(cfg, str(policy), out, 2, gradient_accumulation_steps=4, pipeline_schedule=schedule)
        proc = check(launch(2, *args))
        assert "reference log-probs of 40 pairs computed" in proc.stderr  # each schedule's own pass
        (cached,) = (out / "data_cache" / "reference_logps").iterdir()
        runs[schedule] = (read_jsonl(out / "metrics.jsonl"), final_weights(out), np.load(cached))
    (base, weights, reference) = runs["1f1b"]
    for schedule, (metrics, got, scores) in runs.items():
        np.testing.assert_allclose(scores, reference, rtol=1e-6, atol=1e-6, err_msg=schedule)
        for key in ("loss", "grad_norm", "rewards/margins"):
            ours, theirs = torch.tensor([m[key] for m in metrics]), torch.tensor([m[key] for m in base])
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=f"{schedule} {key}")
        assert got.keys() == weights.keys()
        for key, value in weights.items():
            torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-6)


@case
def dpo_pair_without_rejected_on_two_ranks(t):
    """objective=dpo: a pair row missing 'rejected' is named by file and line, on both ranks (PP=2)."""
    data = t.tmp / "pairs.jsonl"
    data.write_text('{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}\n{"prompt": "2+2=", "chosen": " 4"}\n')
    cmd = [
        LAUNCHER,
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "trainer.py",
        *run_args(t.ckpt, t.out, str(data), num_stages=2, objective="dpo"),
    ]
    return cmd, f"{data}:2: preference rows need 'chosen' and 'rejected'", t.out, [t.ckpt, data], 2


@case
def dpo_prompts_filling_seq_length(t):
    data = t.tmp / "long_prompts.jsonl"  # every prompt fills seq_length: no completion token survives
    rows = [{"prompt": "one two three four " * 8, "chosen": " five", "rejected": " six"} for _ in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data), objective="dpo"))
    return cmd, f"{data}: none of the 4 pairs has a completion token within seq_length=16", t.out, [t.ckpt, data]


@case
def dpo_reference_of_another_architecture(t):
    data = t.tmp / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in STRING_PAIRS))
    cmd = trainer_cmd(*run_args(t.ckpt, t.out, str(data), objective="dpo", **{"dpo.reference_model": t.mha_ckpt}))
    message = f"dpo.reference_model {t.mha_ckpt}: num_key_value_heads=4 but the policy has num_key_value_heads=2"
    return cmd, message, t.out, [t.ckpt, t.mha_ckpt, data]


@pytest.mark.parametrize("name", list(BAD_PAIRS))
def test_bad_pairs(name, hf_models, converted, sft_data, tmp_path, monkeypatch):
    run_case(BAD_PAIRS[name], Inputs(tmp_path, hf_models, converted, sft_data), monkeypatch)
