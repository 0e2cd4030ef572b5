"""Training through the real launcher matches a single-process HF reference; resume is exact."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from checkpoint.pipeline_reader import load_hf_state_dict
from checkpoint.safe_load import load_pt
from checkpoint.universal import convert_to_universal
from models.hub_names import hub_key, memory_key
from models.key_table import is_carried
from schema.train import OptimConfig, TrainConfig
from tests.baseline import baseline_eval, hub_state_dict, train_baseline
from tests.conftest import built_once, check, deepspeed_launch, hf_state, launch, read_jsonl, run_cmd, shared_path
from tests.layouts import LAYOUTS
from tests.packing_reference import assert_packing_report
from tests.resumes import assert_resumed_exactly, interrupted_copy

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

STEPS = 4


def parity_cfg(train_file: str) -> TrainConfig:
    # Clipping at 0.5 is active on these steps, so a wrong global grad norm would show.
    return TrainConfig(
        train_file=train_file,
        seq_length=16,
        micro_batch_size=2,
        gradient_accumulation_steps=3,
        max_steps=STEPS,
        learning_rate=3e-3,
        seed=7,
        optim=OptimConfig(weight_decay=0.1, max_grad_norm=0.5, warmup_steps=1, lr_scheduler="cosine"),
    )


def overrides(cfg: TrainConfig, ckpt: str, out: str, num_stages: int, **extra) -> list[str]:
    args = dict(
        model_name_or_path=ckpt,
        output_dir=out,
        num_stages=num_stages,
        train_file=cfg.train_file,
        do_eval="false",
        max_steps=cfg.max_steps,
        seq_length=cfg.seq_length,
        micro_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        seed=cfg.seed,
        **{
            "optim.weight_decay": cfg.optim.weight_decay,
            "optim.max_grad_norm": cfg.optim.max_grad_norm,
            "optim.warmup_steps": cfg.optim.warmup_steps,
            "deepspeed": "fp32",
        },
    )
    args.update(extra)
    return [f"{k}={v}" for k, v in args.items()]


# The layout runs that resume and layout-move tests continue from their step 2 (saved there too).
RESUMED = {
    "tied-pp2-dp2",
    "gqa-pp2-dp2-packed-recompute2-chunked",
    "qwen3_moe-pp2-tp2-chunked",
    "mixtral-pp2-dp2-ep2-recompute",
    "gqa-pp2-cp2-packed-recompute-chunked-tiled",
    "gpt_oss-pp2-dp2-ep2",
    "deepseek_v3-pp2-dp2-ep2-balanced",
    "qwen3_next-pp2-dp2-ep2-recompute",
}

# Micro-batches per step: 3, or 4 where tests/test_schedules.py's DualPipeV (which needs 2 x PP) shares the 1F1B run.
LAYOUT_GAS = {"gqa-pp2-dp2-packed-recompute2-chunked": 4, "gqa-pp2-tp2-chunked": 4, "mixtral-pp2-dp2-ep2-recompute": 4}


def layout_config(layout: str, sft_data, gas: int | None = None) -> TrainConfig:
    """The parity config of `layout` (its rows arranged, `gas` micro-batches per step, default the layout's)."""
    arrangement = LAYOUTS[layout][4]
    cfg = parity_cfg(sft_data[0])
    cfg.gradient_accumulation_steps = gas or LAYOUT_GAS.get(layout, 3)
    if arrangement:
        setattr(cfg.data, arrangement, True)
        cfg.seq_length = 40  # room for several rows in each packed row or block
    if layout.endswith("-balanced"):
        cfg.moe.bias_update_rate = 2e-3  # DeepSeek-V3's balancing (its own rate is 1e-3 per step)
    if layout == "qwen2-tp2-dp2-recompute":
        cfg.seq_length -= 1  # an odd length: sequence parallelism pads it inside to a multiple of TP=2
    return cfg


def layout_run(
    layout: str,
    converted,
    sft_data,
    tmp_path_factory,
    schedule: str = "1f1b",
    gas: int | None = None,
    sequence_parallel: bool = True,
) -> str:
    """The 4-rank run of `layout` with `schedule` (STEPS steps, then an evaluation of every eval row): launched
    once per session, by whichever pytest worker needs it first, for every test that reads it. TP layouts run
    with sequence parallelism (the default) unless `sequence_parallel` is false."""
    gas = layout_config(layout, sft_data, gas).gradient_accumulation_steps
    root = shared_path(tmp_path_factory, f"run_{layout}_{schedule}_gas{gas}" + ("" if sequence_parallel else "_nosp"))
    out = str(root / "run")
    args = layout_args(layout, converted, sft_data, out, schedule, gas, sequence_parallel)
    built_once(root, lambda: check(launch(4, *args)))
    return out


def layout_args(
    layout: str, converted, sft_data, out: str, schedule: str = "1f1b", gas=None, sequence_parallel=True, **more
) -> list[str]:
    """The trainer overrides of `layout_run` (`more` adds or replaces keys). The RESUMED layouts' 1F1B runs save at
    step 2 too: the resume and layout-move tests continue from there."""
    variant, recompute, stages, tp, arrangement, chunk = LAYOUTS[layout]
    cfg = layout_config(layout, sft_data, gas)
    gas = cfg.gradient_accumulation_steps
    extra = {
        "model.activation_checkpointing": recompute,
        "tensor_parallel_size": tp,
        "model.loss_chunk_size": chunk,
        "gradient_accumulation_steps": gas,
        "pipeline_schedule": schedule,
        "eval_file": sft_data[1],  # eval packs too: it must still score every eval row (or block) once, exactly
        "do_eval": "true",
        "eval_micro_batch_size": 3,
    }
    if layout in RESUMED and schedule == "1f1b":
        extra["save_steps"] = 2
    if not sequence_parallel:
        extra["sequence_parallel"] = "false"
    if "-ep2" in layout:
        extra["expert_parallel_size"] = 2
    if cfg.moe.bias_update_rate:
        extra["moe.bias_update_rate"] = cfg.moe.bias_update_rate
    if "-cp2" in layout:
        extra["context_parallel_size"] = 2
    if layout.endswith("-tiled"):
        extra["model.mlp_tiles"] = 3  # DeepSpeed's TiledMLP
    if arrangement:
        extra[f"data.{arrangement}"] = "true"
    stages = more.pop("num_stages", stages)
    return overrides(cfg, converted[variant], out, stages, **{**extra, **more})


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_single_process_reference(layout, hf_models, converted, sft_data, tmp_path, tmp_path_factory):
    """4 ranks as PP x TP x CP x DP; every layout's steps equal one HF model trained on the same global batches
    (with packing: the same rows, unpacked), and its evaluation the same model's over every eval row."""
    from transformers import AutoConfig, AutoModelForCausalLM

    variant, recompute, stages, tp, arrangement, chunk = LAYOUTS[layout]
    cfg = layout_config(layout, sft_data)
    out = layout_run(layout, converted, sft_data, tmp_path_factory)
    dp = 4 // (stages * tp * (2 if "-cp2" in layout else 1))
    ours, worst = assert_matches_reference(out, cfg, hf_models[variant], sft_data, dp=dp, layout=layout)
    export = tmp_path / "hf_export"  # the trained checkpoint exported to Hugging Face is the same model
    check(run_cmd([sys.executable, "convert2ckpt.py", "--to-hf", "--input", out, "--output", str(export)]))
    AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)  # transformers loads it
    config = AutoConfig.from_pretrained(out)
    exported = hf_state(str(export))  # the hub's keys (one per expert), the tied head once
    ours |= {k: v for k, v in hf_state(hf_models[variant]).items() if is_carried(k, config)}  # untrained, as it was
    assert set(exported) | {hub_key(config, "lm_head.weight")} == set(ours)  # (DeepSeek-V4's: `head.weight`)
    assert (export / "generation_config.json").exists()
    for key in exported:  # as bytes (a 0-dim tensor, Apertus's xIELU constants, as a row of one)
        assert torch.equal(exported[key].reshape(-1).view(torch.uint8), ours[key].reshape(-1).view(torch.uint8)), key
    moved = max(float((ours[k] - v).abs().max()) for k, v in load_hf_state_dict(converted[variant], config).items())
    assert moved > 1e-3, "weights should have changed"
    cp = " x CP=2" if "-cp2" in layout else ""
    print(
        f"training parity ({layout}, PP={stages} x TP={tp} x DP={dp}{cp}): max |weight diff| "
        f"after {STEPS} steps = {worst:.3g}, weights moved {moved:.3g}"
    )


# Max |weight difference| against the single-process reference after 4 steps, as docs/measured.md quotes it, for the
# layouts where 10x that figure is well below the shared bound (1% of lr = 3e-5): they are held at 10x.
MEASURED_WEIGHT_DIFF = {
    "llama4-pp2-dp2-ep2": 1.86e-7,
    "ministral3-pp2-dp2": 6.11e-7,
    "gqa-pp2-cp2-packed-recompute-chunked-tiled": 6.92e-7,
    "qwen3_5-pp2-dp2": 7.04e-7,
    "mixtral-dp4-ep2": 7.4e-7,
    "phi3-pp2-dp2": 9.02e-7,
    "ernie4_5-pp2-dp2": 1.01e-6,
    "seed_oss-pp2-tp2": 1.14e-6,
    "llama4-pp2-cp2": 1.25e-6,
    "gqa-pp2-dp2-packed-recompute2-chunked": 1.44e-6,
    "mixtral-pp2-cp2-ep2-recompute": 1.49e-6,
    "smollm3-pp2-dp2": 1.52e-6,
    "tied-pp2-dp2": 1.9e-6,
    "olmo3-pp2-dp2": 2.02e-6,
    "deepseek_v3-pp2-dp2-ep2-balanced": 2.43e-6,
    "gpt_oss-pp2-dp2-ep2": 2.49e-6,
}


def assert_matches_reference(
    out: str, cfg: TrainConfig, hf_dir: str, sft_data, dp: int, layout: str, schedule: str = "1f1b", scale=None
):
    """The run in `out` (of `layout` with `schedule`) against the single-process HF reference: losses, grad norms,
    tokens, eval, weights (within the layout's bound below, or within `scale` x each tensor's largest value). Returns
    (its weights in HF names, the largest difference from the reference's)."""
    from transformers import AutoConfig

    arrangement = LAYOUTS[layout][4]
    # NOTE: the tokenizer as the trainer loads it from the model directory: transformers picks the tokenizer
    # class from config.json's model_type (Qwen2Tokenizer for a qwen2 directory), not from tokenizer_dir.
    split = cfg.seq_length // 2 if "-cp2" in layout else 0
    ref_model, ref_losses, ref_norms = train_baseline(hf_dir, hf_dir, cfg, dp=dp, steps=STEPS, cp_split=split)
    if ref_model.router_control:  # negative control: the router statistics without their CP sum
        relative, moved, fewest = ref_model.router_control
        print(
            f"router statistics under CP: without the sum, transformers' load-balancing loss moves by up to "
            f"{relative:.3g} (relative; forward parity holds it at 1e-6 under CP), the first step's loss by {moved:.3g}"
        )
        # both shards hold tokens; aux would fail forward parity's 1e-6 by 100x, the loss this test's bound
        assert fewest > 0 and relative > 100 * 1e-6 and abs(moved) > 1e-6 + 1e-5 * ref_losses[0], (
            ref_model.router_control
        )

    metrics = read_jsonl(f"{out}/metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # Throughput counts each step's tokens that are not padding: exactly those of its rows, packed or not.
    assert [m["input_tokens"] for m in metrics] == ref_model.step_tokens
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6
    )
    assert all(n > cfg.optim.max_grad_norm for n in ref_norms[:2]), "clipping should be active in this test"
    if "moe" in layout or "mixtral" in layout:  # transformers' load-balancing loss, reported per step
        assert all(m["aux_loss"] > 1.0 and m["expert_load_max"] >= 1.0 for m in metrics)

    results = json.load(open(f"{out}/eval_results.json"))
    ref_loss, ref_tokens = baseline_eval(ref_model, hf_dir, sft_data[1], cfg)
    assert results["eval_tokens"] == ref_tokens
    assert results["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
    if arrangement:
        report = json.load(open(f"{out}/data_report.json"))["train"]
        if arrangement == "packing":  # the report against the data itself, not against figures the code gave
            assert_packing_report(report, hf_dir, sft_data[0], cfg.seq_length)
        else:  # no padding at all: every block is full
            assert report["padding_share_packed"] == 0 and report["blocks"] == report["tokens"] // cfg.seq_length
            assert report["tokens_dropped"] == report["tokens"] % cfg.seq_length

    config = AutoConfig.from_pretrained(out)
    ours = load_hf_state_dict(out, config)
    ref = hub_state_dict(ref_model)
    assert set(ours) == set(ref)
    # NOTE: Adam turns a gradient into a step of about lr whatever its size, so the fp32 summation-order
    # differences of near-zero gradients (DP all-reduce, micro-batch accumulation) can move single
    # elements by a small fraction of lr. The bound is 1% of one step's lr; typical elements agree to 1e-7.
    # One element measured above 1% of lr: Qwen3 (q/k norms, TP) 1.02% of 8192, Phi-3 (fused q/k/v, gate/up, TP)
    # 2.08% of 4096, GLM-4.5 (TP x EP) 1.58% of an expert's 4096 (2.60% on an AMD EPYC machine: held at 3%),
    # Qwen3.5 (TP) 0.82% in an MLP weight (held at 2%); losses and grad norms within the bounds above.
    # TP gradients are held to the whole block's in tests/test_tensor_parallel.py.
    wider = {"qwen3-pp2-tp2": 0.02, "phi3-pp2-tp2": 0.03, "glm4_moe-tp2-dp2-ep2": 0.03, "qwen3_5-pp2-tp2": 0.02}
    # Gemma 4 under TP: one MLP element at 1.99% of lr; its fp32 reference against the same training in fp64 moves one
    # 2.79% (8.36e-5; Qwen3's 0.51%, Gemma 3's 1.0%). Its MoE block: one element 1.31% of lr in one suite, 4.22% in
    # another (the same run, its reference computed after other tests or alone; fp32 against fp64: 1.02%); one step's
    # gradients of the TP=2 model within 6.66e-6 of the whole model's (tests/test_shared_state.py).
    wider |= {"gemma4-pp2-tp2": 0.03, "gemma4_moe-pp2-tp2": 0.05}
    # `A_log`, a per-head decay whose gradient nearly cancels: Qwen3-Next 1.15% of lr, Qwen3.5-MoE under DualPipeV 0.94%
    wider["qwen3_next-pp2-dp2-ep2-recompute"] = 0.02
    if schedule == "dualpipev":
        wider["qwen3_5_moe-pp2-dp2-ep2"] = 0.02
        wider["gemma4-pp2-dp2"] = 0.02  # one MLP element 0.52% of lr alone, 1.05% (3.16e-5) in one CI suite
    atol, rtol = wider.get(layout, 0.01) * cfg.learning_rate, 1e-5
    if layout in MEASURED_WEIGHT_DIFF:  # held at 10x what it measured, no relative term
        atol, rtol = 10 * MEASURED_WEIGHT_DIFF[layout], 0.0
    if scale is not None:  # each tensor to a share of its own scale
        atol, rtol = None, 0.0
    biases = [k for k in ref if memory_key(config, k).endswith("e_score_correction_bias")]  # moved by balancing only
    assert all(torch.equal(ours[key], ref[key]) for key in biases)
    assert any(ref[key].any() for key in biases) == bool(cfg.moe.bias_update_rate)
    diffs = {key: float((ours[key] - value).abs().max()) for key, value in ref.items()}
    for key, value in ref.items():
        bound = atol if scale is None else scale * float(value.abs().max())
        torch.testing.assert_close(ours[key], value, rtol=rtol, atol=bound, msg=lambda m, k=key: f"{k}: {m}")
    worst = max(diffs, key=diffs.get)
    print(f"largest weight difference: {worst} {diffs[worst]:.3g}")
    return ours, diffs[worst]


def test_resume_matches_uninterrupted(converted, sft_data, tmp_path, tmp_path_factory):
    """N steps straight vs N/2, stop, resume with the same command: identical losses and weights. With packed
    rows (the unpacked resume is also exact in test_faults.py), so the packed rows are rebuilt identically, every
    2nd block recomputed and the loss in chunks (the layout run of test_training_matches_single_process_reference)."""
    from transformers import AutoConfig

    layout = "gqa-pp2-dp2-packed-recompute2-chunked"
    full = layout_run(layout, converted, sft_data, tmp_path_factory)
    part = tmp_path / "part"
    interrupted_copy(Path(full), part, 2)
    check(launch(4, *layout_args(layout, converted, sft_data, str(part), resume="true")))

    assert len(read_jsonl(part / "metrics.jsonl")) == STEPS
    # Optimizer state too (the next steps would diverge otherwise): the saved Adam moments, bit for bit.
    assert_resumed_exactly(Path(full), part, 2)
    config = AutoConfig.from_pretrained(full)
    a, b = load_hf_state_dict(full, config), load_hf_state_dict(str(part), config)
    assert all(torch.equal(a[key], b[key]) for key in a)


def test_fp32_zero0_checkpoint_moves_between_layouts(converted, sft_data, tmp_path, tmp_path_factory):
    """ZeRO-0 optimizer state (DeepSpeed's universal tool cannot read it) is reshaped by parameter name:
    step 2 of 4 saved with PP=2 x DP=2 (the layout run of test_training_matches_single_process_reference) continues
    in PP=4 x DP=1 (explicit partition) and PP=1 x DP=2 (same global batch) on the unmoved run's loss curve, to
    fp32 reduction-order noise."""
    from transformers import AutoConfig

    layout = "tied-pp2-dp2"
    full = Path(layout_run(layout, converted, sft_data, tmp_path_factory))
    expected = read_jsonl(full / "metrics.jsonl")
    config = AutoConfig.from_pretrained(full)
    final = load_hf_state_dict(str(full), config)
    for name, ranks, stages, gas, extra in [
        ("pp4_dp1", 4, 4, 6, {"model.partition": "[1,1,1,1]"}),
        ("pp1_dp2", 2, 1, 3, {}),
    ]:
        part = tmp_path / name
        interrupted_copy(full, part, 2)
        more = dict(num_stages=stages, resume="true", gradient_accumulation_steps=gas, **extra)
        proc = check(launch(ranks, *layout_args(layout, converted, sft_data, str(part), **more)))
        assert "optimizer state reshaped by parameter name" in proc.stdout + proc.stderr
        got = read_jsonl(part / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for a, b in zip(expected[2:], got[2:], strict=True):
            assert a["lr"] == b["lr"], (a, b)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
                a["grad_norm"], rel=1e-4
            ), (name, a, b)
        # Without the Adam moments the first moved step would differ by about lr in every weight.
        moved = load_hf_state_dict(str(part), config)
        worst = max(float((moved[k] - v).abs().max()) for k, v in final.items())
        print(f"ZeRO-0 move PP=2xDP=2 -> {name}: max |weight diff| after {STEPS} steps vs unmoved = {worst:.3g}")
        assert worst < 1e-6, (name, worst)  # measured 1.19e-7 for both moves

    # The same number of rows with one row changed: the data order would not continue. Refused on every rank (the
    # rule itself, in any layout, is tests/test_engine_config.py::test_resume_refuses_a_different_data_order).
    lines = open(sft_data[0]).read().splitlines(keepends=True)
    lines[5] = json.dumps({"prompt": "1+1=", "response": "2"}) + "\n"
    changed = tmp_path / "changed.jsonl"
    changed.write_text("".join(lines))
    part = tmp_path / "changed_moved"
    interrupted_copy(full, part, 2)
    more = dict(num_stages=4, resume="true", gradient_accumulation_steps=6, train_file=str(changed))
    more["model.partition"] = "[1,1,1,1]"
    # The real launcher: each rank refuses on its own, and torchrun's agent (as the fork server) stops the others at
    # once, perhaps before they print; the deepspeed launcher looks once a second.
    proc = deepspeed_launch(4, *layout_args(layout, converted, sft_data, str(part), **more))
    refused = [line for line in proc.stderr.splitlines() if "the tokenized training rows differ" in line]
    assert proc.returncode != 0 and len(refused) == 4 and "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_bf16_zero1_trains_resumes_and_moves_between_layouts(converted, sft_data, tmp_path, tmp_path_factory):
    """The GPU default (bf16 weights, fp32 master weights and grad accumulation, ZeRO-1) on CPU ranks.

    The first step agrees with fp32 to bf16 precision; a checkpoint saved at step 3 of 6 with
    PP=2 x DP=2 resumes exactly in the same layout, and in PP=4 x DP=1 and PP=1 x DP=2 (same
    global batch) it continues the same loss curve, optimizer state and LR schedule included.
    The same-layout resume runs pipeline_schedule=zero_bubble: its queued weight gradients reach the fp32
    gradients ZeRO-1 reduces exactly as 1F1B's backward puts them there (losses and norms equal).
    """
    cfg = parity_cfg(sft_data[0])
    cfg.max_steps = 6
    full = tmp_path / "bf16"
    fp32 = Path(layout_run("tied-pp2-dp2", converted, sft_data, tmp_path_factory))  # the same first step, in fp32
    bf16 = dict(save_steps=3, deepspeed="bf16_zero1")
    check(launch(4, *overrides(cfg, converted["tied"], str(full), num_stages=2, **bf16)))
    zero_files = {f"bf16_zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(2) for s in range(2)}
    assert zero_files <= set(os.listdir(full / "global_step3"))  # ZeRO-1: optimizer state sharded over DP
    scripts = {"zero_to_fp32.py", "zero_to_torch.py"}  # DeepSpeed's, which cannot read pipeline checkpoints
    assert not scripts & (set(os.listdir(full)) | set(os.listdir(full / "global_step3")))
    ref, ours = read_jsonl(fp32 / "metrics.jsonl")[0], read_jsonl(full / "metrics.jsonl")[0]
    assert ours["loss"] == pytest.approx(ref["loss"], rel=2e-3)
    assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=2e-2)
    expected = read_jsonl(full / "metrics.jsonl")
    verify = run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(full), "--tag", "global_step3"])
    assert verify.returncode == 0, verify.stderr  # manifest hashed by all 4 ranks, written by rank 0
    assert set(json.load(open(full / "global_step3" / "manifest.json"))["files"]) >= zero_files

    # (ranks, num_stages, gradient_accumulation_steps): global batch 12 sequences in every layout.
    for name, ranks, stages, gas in [("same", 4, 2, 3), ("pp4_dp1", 4, 4, 6), ("pp1_dp2", 2, 1, 3)]:
        part = tmp_path / name
        interrupted_copy(full, part, 3)
        schedule = "zero_bubble" if name == "same" else "1f1b"
        args = overrides(
            cfg,
            converted["tied"],
            str(part),
            stages,
            resume="true",
            gradient_accumulation_steps=gas,
            pipeline_schedule=schedule,
            **bf16,
        )
        proc = check(launch(ranks, *args))
        got = read_jsonl(part / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, 7)) and os.path.isdir(part / "global_step6")
        for a, b in zip(expected[3:], got[3:], strict=True):
            assert a["lr"] == b["lr"]
            if name == "same":  # bit-identical, under the zero_bubble schedule
                assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
            else:  # other reduction order in bf16: agreement to bf16 noise
                assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and b["grad_norm"] == pytest.approx(
                    a["grad_norm"], rel=2e-2
                )
        assert (name == "same") != os.path.isdir(part / "global_step3_universal"), proc.stdout[-2000:]
        if name == "pp4_dp1":
            inspect = run_cmd([sys.executable, "convert2ckpt.py", "--inspect", str(part), "--json"])
            info = json.loads(inspect.stdout)
            assert info["step"] == 6 and info["layout"]["num_stages"] == 4 and info["layout"]["dp_size"] == 1
            assert info["optimizer_state"].startswith("ZeRO-1 shards over DP=1") and info["dtype"] == {"bfloat16": 19}

    # Each move converted in the rank's own process (a small checkpoint); a child process writes the same files.
    child = tmp_path / "child_universal"
    convert_to_universal(str(part / "global_step3"), str(child), experts=False, in_process=False)
    assert_same_files(part / "global_step3_universal", child)

    # (A different global batch is refused: tests/test_engine_config.py::test_resume_refuses_a_different_data_order.)


def assert_same_files(a: Path, b: Path) -> None:
    """The same files under `a` and `b`, equal byte for byte or, where torch.save's archive differs, in content."""
    names = [sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) for root in (a, b)]
    assert names[0] == names[1] and names[0], names
    for name in names[0]:
        if (a / name).read_bytes() != (b / name).read_bytes():
            x, y = (load_pt(str(root / name)) for root in (a, b))
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


def test_trained_checkpoint_loads_into_other_layouts(converted, sft_data, tmp_path, tmp_path_factory):
    """Weights saved by PP=2 x DP=2 load into PP=4 x DP=1 and PP=1: same eval loss as the run itself."""
    cfg = parity_cfg(sft_data[0])
    trained = layout_run("tied-pp2-dp2", converted, sft_data, tmp_path_factory)
    results = {"pp2": json.load(open(os.path.join(trained, "eval_results.json")))}
    for name, n, stages in [("pp4", 4, 4), ("pp1", 1, 1)]:
        args = overrides(cfg, trained, str(tmp_path / name), stages, do_train="false", do_eval="true")
        check(launch(n, *args, f"eval_file={sft_data[1]}"))
        results[name] = json.load(open(tmp_path / name / "eval_results.json"))
    assert results["pp2"]["eval_tokens"] == results["pp4"]["eval_tokens"] == results["pp1"]["eval_tokens"]
    for name in ("pp4", "pp1"):
        assert results[name]["eval_loss"] == pytest.approx(results["pp2"]["eval_loss"], rel=1e-6), results


def test_hf_directory_is_converted_on_load_and_reused(hf_models, converted, sft_data, tmp_path, tmp_path_factory):
    """model_name_or_path = an HF directory: each stage converts its layers, training equals the
    run from convert2ckpt.py's checkpoint (the layout run of test_training_matches_single_process_reference), and a
    second run reuses the conversion."""
    cfg = parity_cfg(sft_data[0])
    cfg.max_steps = 2
    direct, on_load = Path(layout_run("gqa-pp2-dp2", converted, sft_data, tmp_path_factory)), tmp_path / "on_load"
    more = dict(model_name_or_path=hf_models["gqa"])
    first = check(launch(4, *layout_args("gqa-pp2-dp2", converted, sft_data, str(on_load), **more)))
    assert "converted " in first.stderr and (on_load / "hf_converted" / "conversion.json").exists()
    assert run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(on_load / "hf_converted")]).returncode == 0
    timing = ("tokens_per_second", "padded_tokens_per_second", "step_seconds", "save_seconds", "rss_before_step_gib")
    timing += ("peak_rss_gib",)  # host memory: measured, not reproduced
    a, b = read_jsonl(direct / "metrics.jsonl"), read_jsonl(on_load / "metrics.jsonl")
    assert len(a) == STEPS and [{k: v for k, v in m.items() if k not in timing} for m in a] == [
        {k: v for k, v in m.items() if k not in timing} for m in b
    ]
    assert json.load(open(direct / "eval_results.json")) == json.load(open(on_load / "eval_results.json"))
    again = tmp_path / "again"
    shutil.copytree(on_load / "hf_converted", again / "hf_converted")
    second = check(launch(2, *overrides(cfg, hf_models["gqa"], str(again), 2)))  # any layout reuses it
    assert "reusing the conversion of" in second.stderr
    broken = tmp_path / "broken_hf"
    shutil.copytree(hf_models["gqa"], broken)
    os.remove(broken / sorted(n for n in os.listdir(broken) if n.endswith(".safetensors"))[0])
    bad = launch(2, *overrides(cfg, str(broken), str(tmp_path / "bad"), 2))
    assert bad.returncode != 0 and "shard listed in the index is missing" in bad.stderr
    assert not (tmp_path / "bad" / "hf_converted").exists()


def test_optimizer_offload_trains_as_zero0(converted, sft_data, tmp_path, tmp_path_factory):
    """ZeRO-Offload (fp16_offload's optimizer on CPU, our AdamW stepping DeepSpeed's CPU partitions) in fp32 on CPU
    ranks: PP=2 x DP=2 gives the ZeRO-0 run's losses and grad norms (DeepSpeed refused our optimizer before)."""
    layout = "tied-pp2-dp2"
    expected = read_jsonl(Path(layout_run(layout, converted, sft_data, tmp_path_factory)) / "metrics.jsonl")
    offload = {"deepspeed.zero_stage": 1, "deepspeed.offload_optimizer": "true", "save_steps": 0}
    check(launch(4, *layout_args(layout, converted, sft_data, str(tmp_path), **offload)))
    for a, b in zip(expected, read_jsonl(tmp_path / "metrics.jsonl"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-4
        ), (a, b)
