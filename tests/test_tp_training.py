"""Tensor parallelism end to end on CPU ranks (gloo): sequence parallelism against TP without it, resuming across TP
and PP, LoRA under TP, and any checkpoint loading into TP=4. Parity of TP training steps with the single-process
reference is in test_training.py (`-k single_process_reference`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from checkpoint.pipeline_reader import load_hf_state_dict
from tests.conftest import check, launch, read_jsonl, run_cmd
from tests.test_lora import LORA, assert_merged_export_is_peft, lora_overrides
from tests.test_training import (
    STEPS,
    interrupted_copy,
    layout_args,
    layout_config,
    layout_run,
    overrides,
    parity_cfg,
)

pytestmark = pytest.mark.slow  # launches the trainer on several ranks


@pytest.mark.parametrize(
    "precision,variant",
    [
        *(("fp32", "tied"), ("bf16_zero1", "tied"), ("fp32", "qwen3_moe"), ("fp32", "phi3"), ("bf16_zero1", "phi3")),
        ("bf16_zero1", "qwen3_5"),
    ],
)
def test_resume_moves_across_tp_and_pp(precision, variant, converted, sft_data, tmp_path, tmp_path_factory):
    """Saved with PP=2 x TP=2 (sequence parallel) at step 3 of 6, resumed as PP=2 x TP=1 (2 ranks), PP=4 x TP=1
    (4 ranks) and (fp32) PP=2 x TP=2 without sequence parallelism: the loss curve, LR and (fp32) final weights
    continue the unmoved run's. fp32 (ZeRO-0) moves its Adam
    moments by parameter name, merged and split across TP; bf16 + ZeRO-1 through DeepSpeed's universal
    checkpoint with our split rules (checkpoint/universal.universal_info). Qwen3-MoE (fp32): the fused experts' Adam
    moments merged and split by their own rules (each rank's gate rows then its up rows), the load-balancing loss
    on; it moves at step 2 of 4 of its layout run in test_training_matches_single_process_reference (with the
    chunked vocab-parallel loss). Phi-3: its fused q/k/v (by heads) and gate/up (by halves) projections' weights and
    Adam moments merged and split part by part, by name (fp32) and through DeepSpeed's sub-parameters (bf16).
    Qwen3.5 (bf16): linear attention's q/k/v projection and depthwise convolution as sub-parameters of their own
    widths and shapes."""
    from transformers import AutoConfig

    if variant == "qwen3_moe":
        layout = "qwen3_moe-pp2-tp2-chunked"
        full, at = Path(layout_run(layout, converted, sft_data, tmp_path_factory)), 2

        def args_for(out: str, **more) -> list[str]:
            return layout_args(layout, converted, sft_data, out, **more)

    else:
        cfg = parity_cfg(sft_data[0])
        cfg.max_steps = 6
        full, at = tmp_path / "full", 3

        def args_for(out: str, **more) -> list[str]:
            stages = more.pop("num_stages", 2)
            return overrides(cfg, converted[variant], out, stages, save_steps=3, deepspeed=precision, **more)

        check(launch(4, *args_for(str(full), tensor_parallel_size=2)))
    expected = read_jsonl(full / "metrics.jsonl")
    config = AutoConfig.from_pretrained(full)
    final = load_hf_state_dict(str(full), config)  # the TP=2 shards merged
    rel = (1e-5, 1e-4) if precision == "fp32" else (2e-3, 2e-2)  # bf16 rounding in another reduction order
    moves = [("tp1_pp2", 2, 2, 1, []), ("tp1_pp4", 4, 4, 1, ["model.partition=[1,1,1,1]"])]
    if precision == "fp32":
        moves.append(("tp2_pp2_no_sp", 4, 2, 2, ["sequence_parallel=false"]))
    for name, ranks, stages, tp, more in moves:
        part = tmp_path / name
        interrupted_copy(full, part, at)
        args = args_for(str(part), num_stages=stages, resume="true", tensor_parallel_size=tp)
        proc = check(launch(ranks, *args, *more))
        assert tp == 2 or "saved with PP=2 x TP=2 x DP=1" in proc.stdout + proc.stderr
        got = read_jsonl(part / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, len(expected) + 1))
        for a, b in zip(expected[at:], got[at:], strict=True):
            assert a["lr"] == b["lr"], (a, b)
            assert b["loss"] == pytest.approx(a["loss"], rel=rel[0]), (name, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel[1]), (name, a, b)
        if precision == "fp32":  # without the Adam moments the first moved step would differ by about lr
            moved = load_hf_state_dict(str(part), config)
            worst = max(float((moved[k] - v).abs().max()) for k, v in final.items())
            print(f"PP=2 x TP=2 -> {name}: max |weight diff| after {len(expected)} steps vs unmoved = {worst:.3g}")
            assert worst < 1e-6, (name, worst)  # measured 0 to 1.19e-7 (tied, Qwen3-MoE; Phi-3 5.4e-8)


@pytest.mark.parametrize("variant", ["gqa", "phi3"])
def test_lora_under_tp_matches_peft_reference(variant, hf_models, converted, tokenizer_dir, sft_data, tmp_path):
    """LoRA on column (q, v) and row (down) layers split over TP=2, PP=2: the PEFT reference's losses, grad norms
    and adapters; the merged export equals PEFT's unmerged adapter model. Phi-3: on its fused q/k/v and gate/up
    (split part by part, LoRA's B with them, A replicated with its gradient summed over TP) and down."""
    import dataclasses

    from tests.test_lora import assert_matches_peft

    cfg = parity_cfg(sft_data[0])
    targets = ["qkv_proj", "gate_up_proj", "down_proj"] if variant == "phi3" else LORA.target_modules
    cfg.lora = dataclasses.replace(LORA, target_modules=targets)
    more = [o for o in lora_overrides() if not o.startswith("lora.target_modules=")]
    more.append("lora.target_modules=[" + ",".join(targets) + "]")
    run = tmp_path / "run"
    check(launch(4, *overrides(cfg, converted[variant], str(run), 2, tensor_parallel_size=2), *more))
    ours = assert_matches_peft(run, cfg, hf_models[variant], tokenizer_dir, dp=1)  # TP shards merged
    assert_merged_export_is_peft(run, hf_models[variant], ours, targets, tmp_path / "merged")


def test_tp4_starts_from_hf_dir_t1_and_t2_checkpoints(hf_models, converted, sft_data, tmp_path):
    """PP=1 x TP=4 evaluates the same model from a Hugging Face directory (converted at load), a TP=1 conversion
    and a TP=2 conversion (each rank slices its share of every layer at load) as one rank at TP=1 does."""
    hf, t1, t2 = hf_models["mha"], converted["mha"], tmp_path / "t2"
    check(run_cmd([sys.executable, "convert2ckpt.py", "--input", hf, "--output", str(t2), "--tp", "2"]))
    cfg = parity_cfg(sft_data[0])
    common = {"do_train": "false", "do_eval": "true", "eval_file": sft_data[1]}
    check(run_cmd([sys.executable, "trainer.py", *overrides(cfg, t1, str(tmp_path / "tp1"), 1, **common)]))
    expected = json.load(open(tmp_path / "tp1" / "eval_results.json"))
    for name, source in [("hf_dir", hf), ("t1", t1), ("t2", str(t2))]:
        out = tmp_path / f"tp4_{name}"
        check(launch(4, *overrides(cfg, source, str(out), 1, tensor_parallel_size=4, **common)))
        got = json.load(open(out / "eval_results.json"))
        assert got["eval_tokens"] == expected["eval_tokens"]
        assert got["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-6), (name, got, expected)


@pytest.mark.parametrize("layout", ["gqa-pp2-tp2-chunked", "qwen2-tp2-dp2-recompute"])
def test_sequence_parallel_training_equals_tp_without_it(layout, hf_models, converted, sft_data, tmp_path_factory):
    """The TP layouts train with sequence parallelism by default (their parity with the single-process reference
    is test_training_matches_single_process_reference). The same layout with sequence_parallel=false: equal
    losses, grad norms, evaluation and weights (PP=2 x TP=2 with the chunked vocab-parallel loss; TP=2 x DP=2
    with tied embeddings, Qwen2's biases and recompute)."""
    from transformers import AutoConfig

    with_sp = layout_run(layout, converted, sft_data, tmp_path_factory)
    without = layout_run(layout, converted, sft_data, tmp_path_factory, sequence_parallel=False)
    a, b = read_jsonl(f"{with_sp}/metrics.jsonl"), read_jsonl(f"{without}/metrics.jsonl")
    assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(1, STEPS + 1))
    for x, y in zip(a, b, strict=True):
        assert x["lr"] == y["lr"] and x["input_tokens"] == y["input_tokens"]
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6) and x["grad_norm"] == pytest.approx(
            y["grad_norm"], rel=1e-5
        )
    ea, eb = (json.load(open(f"{d}/eval_results.json")) for d in (with_sp, without))
    assert ea["eval_tokens"] == eb["eval_tokens"] and ea["eval_loss"] == pytest.approx(eb["eval_loss"], rel=1e-6)
    config = AutoConfig.from_pretrained(with_sp)
    wa, wb = load_hf_state_dict(with_sp, config), load_hf_state_dict(without, config)
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < 0.01 * layout_config(layout, sft_data).learning_rate, worst
    print(f"sequence parallel vs not ({layout}): max |weight diff| after {STEPS} steps = {worst:.3g}")
