"""Expert parallelism through the real launcher: a checkpoint resumes with any E (fp32 ZeRO-0), and DeepSpeed's
own optimizers (bf16, ZeRO-1) train EP runs as the fp32 ZeRO-0 run does (training/expert_parallel.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from checkpoint.pipeline_reader import load_hf_state_dict
from checkpoint.safe_load import load_pt
from checkpoint.universal import convert_to_universal
from tests.conftest import check, launch, read_jsonl, torchrun
from tests.resumes import assert_resumed_exactly, interrupted_copy
from tests.test_training import STEPS, assert_same_files, layout_args, layout_run

pytestmark = pytest.mark.slow  # launches the trainer on several ranks
GPT_OSS_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


@pytest.mark.parametrize(
    "layout",
    [
        "mixtral-pp2-dp2-ep2-recompute",
        "gpt_oss-pp2-dp2-ep2",
        "deepseek_v3-pp2-dp2-ep2-balanced",
        "qwen3_next-pp2-dp2-ep2-recompute",
    ],
)
def test_expert_parallel_checkpoint_resumes_with_any_ep(layout, converted, sft_data, tmp_path, tmp_path_factory):
    """A run saved at step 2 of 4 with its experts split over EP=2 (the parity layout's, PP=2 x DP=2): Mixtral;
    gpt-oss (experts fused on the hub, with biases); DeepSeek-V3 with its score biases balanced every step (the
    biases saved with the weights, the step's counts not); Qwen3-Next (linear attention, a gated shared expert, every
    block recomputed). The layer files hold every expert (the hub's 4 per layer,
    biases included) and the optimizer state every expert's Adam moments, so resuming with EP=2 continues the run's
    losses and grad norms bit for bit, and with EP=1 within 1e-6; the others also move to PP=1 x DP=2
    x EP=1 (the state reshaped by parameter name), continuing the curve within 1e-5 (losses) and 1e-4 (norms)."""
    full = Path(layout_run(layout, converted, sft_data, tmp_path_factory))
    layer = load_pt(str(full / "global_step2" / "layer_02-model_00-model_states.pt"))  # block 1: sparse in all four
    experts = {k: v for k, v in layer.items() if ".experts." in k}
    if layout.startswith("mixtral"):
        names = ("w1", "w2", "w3")
        assert set(experts) == {f"block_sparse_moe.experts.{e}.{w}.weight" for e in range(4) for w in names}
    elif layout.startswith("gpt_oss"):  # fused as on the hub: E along dim 0 of each, biases too
        assert {k: v.shape[0] for k, v in experts.items()} == {f"mlp.experts.{n}": 4 for n in GPT_OSS_EXPERTS}
    else:
        assert {k.split(".")[2] for k in experts} == {"0", "1", "2", "3"}
    expected = read_jsonl(full / "metrics.jsonl")
    for ep in (1, 2):
        part = tmp_path / f"ep{ep}"
        interrupted_copy(full, part, 2)
        args = layout_args(layout, converted, sft_data, str(part), resume="true", expert_parallel_size=ep)
        check(launch(4, *args))
        got = read_jsonl(part / "metrics.jsonl")
        if ep == 2:  # as saved: bit for bit
            assert_resumed_exactly(full, part, 2)
        else:  # the experts' gradients now summed in another order (DP all-reduce instead of all-to-all)
            assert [m["step"] for m in got] == [m["step"] for m in expected]
            for a, b in zip(expected[2:], got[2:], strict=True):
                assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["grad_norm"] == pytest.approx(
                    a["grad_norm"], rel=1e-6
                ), (a, b)
    if layout.startswith("mixtral"):
        return
    part = tmp_path / "pp1"  # another PP (and E): the same global batch over DP=2
    interrupted_copy(full, part, 2)
    more = dict(resume="true", expert_parallel_size=1, num_stages=1)
    proc = check(launch(2, *layout_args(layout, converted, sft_data, str(part), **more)))
    assert "optimizer state reshaped by parameter name" in proc.stdout + proc.stderr
    got = read_jsonl(part / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in expected]
    for a, b in zip(expected[2:], got[2:], strict=True):
        assert b["lr"] == a["lr"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)


# Max |weight difference| after 4 steps, held at about 5x what each run measured (docs/measured.md, moe.md); on an
# AMD EPYC machine the DP=4 move measured 5.96e-8: held at 3e-7.
# ZeRO-1 runs against fp32 ZeRO-0 at EP=2 (5.11e-7, 1.09e-6, 2.18e-7, 1.23e-7, 2.12e-7, gpt-oss at TP=2 x EP=2
# 6.63e-7) and the optimizer-state moves against the unmoved run (8.47e-9, 2.13e-8, 1.93e-7, 5.96e-8, gpt-oss
# TP=2 x E=2 -> PP=2 3.57e-8; bf16 E 2 -> 1 1.16e-3).
FP32_WEIGHT_BOUNDS = {
    "fp32_zero1": 3e-6,
    "fp32_zero1_tp2": 6e-6,
    "fp32_zero1_llama4": 1e-6,
    "fp32_zero1_dp4": 1e-6,
    "fp32_zero1_cp2": 1e-6,
    "fp32_zero1_gpt_oss": 3e-6,
    "fp32_zero1_qwen3_5_moe": 2e-6,
}
# bf16 grad norms against the fp32 run: within 5e-3, but gpt-oss's later steps in bf16 drift further with or without
# TP (step 3: 3.1% at TP=2 x EP=2, 2.2% at PP=2 x EP=2 on an AMD EPYC machine). Its first step's stays at 5e-3
# (3.1e-3 measured): the down biases counted once per TP rank put it at 6.2e-2.
BF16_NORM_BOUNDS = {("bf16_zero1_gpt_oss", step): 0.1 for step in (2, 3, 4)}
# Its bf16 losses after the first step within 3e-3 (under a bf16 ulp, 3.9e-3): 1.32e-3 at step 3 when this test runs
# alone (1e-3 held it within the suite, where the runs before it moved it under).
BF16_LOSS_BOUNDS = {("bf16_zero1_gpt_oss", step): 3e-3 for step in (2, 3, 4)}
MOVE_BOUNDS = {
    "fp32_zero1_dp4": 3e-7,
    "fp32_zero1": 2e-7,
    "fp32_zero1_tp2": 1.5e-6,
    "fp32_zero1_llama4": 5e-7,
    "fp32_zero1_gpt_oss": 3e-7,
    "fp32_zero1_qwen3_5_moe": 1e-5,
    "bf16_zero1": 5e-3,
}


def test_expert_parallel_under_zero1_and_bf16(converted, sft_data, tmp_path, tmp_path_factory):
    """Experts split over EP=2 under DeepSpeed's own optimizers (training/expert_parallel.py: our groups in its MoE
    bookkeeping), against the fp32 ZeRO-0 run of the same layout (itself equal to the single-process reference).
    Mixtral PP=2 x DP=2 and DP=4 (expert-data groups of 1 and of 2 ranks): fp32 with ZeRO-1 (DeepSpeed's ZeRO
    optimizer; the experts' gradients summed and their state sharded over their expert-data group) within 1e-6;
    bf16 with ZeRO-1 (the GPU default: DeepSpeed's bf16 optimizer) to bf16
    precision, and its first grad norm within 1e-3 of the same run's at EP=1 (the experts are 0.8% of this model's
    squared norm: counting one EP rank's experts only, or each twice, would move it by 2e-3 or more); Qwen2-MoE
    TP=2 x DP=2 with its experts split over TP and EP at once (the Qwen3-30B-A3B recipe's layout) in the GPU
    default; Mixtral PP=2 x CP=2 with its experts split over the CP ranks, in both. bf16 ZeRO-1 saved at step 2
    resumes bit for bit; and moves, its optimizer state with it, to another E (2 -> 1; fp32 ZeRO-1 DP=4 x E=2 -> 4),
    PP and E (fp32 ZeRO-1 PP=2 x DP=2 x E=2 -> PP=1 x DP=2 x E=1) and TP (fp32 ZeRO-1 Qwen2-MoE TP=2 -> PP=2; Llama 4's
    x @ W experts TP=2 x E=2 -> PP=2 x E=1; gpt-oss's experts with their biases and Qwen3.5-MoE's experts fused on the
    hub, each TP=2 x E=2 -> PP=2 x E=1). DeepSeek-V3 at PP=2 x DP=2 x EP=2 with its score biases balanced, in bf16
    (every bias fp32 and equal to the fp32 run's). gpt-oss
    at TP=2 x EP=2 holds each down bias whole on both TP ranks: bf16's first grad norm within 5e-3 of fp32's (counted
    once per TP rank it is 6% higher)."""
    from transformers import AutoConfig

    mixtral, qwen = "mixtral-pp2-dp2-ep2-recompute", "qwen2_moe-tp2-dp2-ep2"
    runs = {
        "fp32_zero1": (mixtral, {"deepspeed.zero_stage": 1}),
        "bf16_zero1": (mixtral, {"deepspeed": "bf16_zero1"}),
        "bf16_zero1_ep1": (mixtral, {"deepspeed": "bf16_zero1", "expert_parallel_size": 1}),
        "bf16_zero1_tp2": (qwen, {"deepspeed": "bf16_zero1"}),
        "fp32_zero1_tp2": (qwen, {"deepspeed.zero_stage": 1, "save_steps": 2}),
        "fp32_zero1_llama4": ("llama4-tp2-dp2-ep2", {"deepspeed.zero_stage": 1, "save_steps": 2}),
        "fp32_zero1_dp4": ("mixtral-dp4-ep2", {"deepspeed.zero_stage": 1, "save_steps": 2}),  # expert-data groups of 2
        # the experts split over the 2 context-parallel ranks of PP=2 x CP=2 (each routes its own positions)
        "fp32_zero1_cp2": ("mixtral-pp2-cp2-ep2-recompute", {"deepspeed.zero_stage": 1}),
        "bf16_zero1_cp2": ("mixtral-pp2-cp2-ep2-recompute", {"deepspeed": "bf16_zero1"}),
        # gpt-oss over TP=2 x EP=2: its experts' biases [E, ...] split over EP with the weights (sharded, assembled,
        # moved alike), each down bias whole on both TP ranks and counted once in the norm by each optimizer
        "fp32_zero1_gpt_oss": ("gpt_oss-tp2-dp2-ep2", {"deepspeed.zero_stage": 1, "save_steps": 2}),
        "bf16_zero1_gpt_oss": ("gpt_oss-tp2-dp2-ep2", {"deepspeed": "bf16_zero1"}),
        # Qwen3.5-MoE over TP=2 x EP=2: linear attention split by heads, its experts fused on the hub ([E, 2I, H])
        "fp32_zero1_qwen3_5_moe": ("qwen3_5_moe-tp2-dp2-ep2", {"deepspeed.zero_stage": 1, "save_steps": 2}),
        "bf16_zero1_qwen3_5_moe": ("qwen3_5_moe-tp2-dp2-ep2", {"deepspeed": "bf16_zero1"}),
        # DeepSeek's router over PP=2 x EP=2, its score biases (fp32 buffers) balanced (GLM-4.5's, the same router,
        # checked by hand: weights 1.11e-2 from fp32's, grad norms 5.6e-3 at step 2, its biases equal)
        "bf16_zero1_deepseek_v3": ("deepseek_v3-pp2-dp2-ep2-balanced", {"deepspeed": "bf16_zero1"}),
    }
    for name, (layout, more) in runs.items():
        fp32 = Path(layout_run(layout, converted, sft_data, tmp_path_factory))
        expected = read_jsonl(fp32 / "metrics.jsonl")
        out = tmp_path / name
        check(launch(4, *layout_args(layout, converted, sft_data, str(out), **more)))
        got = read_jsonl(out / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        exact = name.startswith("fp32")  # bf16: weights and activations rounded every step
        for a, b in zip(expected, got, strict=True):
            # fp32: within 1e-6 (the docstring's claim); a 1e-7 bound, one fp32 ulp, failed on one machine (1.26e-7
            # on Llama 4's step 2) and passed on another: the summation order of a CPU's matmul kernels.
            bound = 1e-6 if exact else BF16_LOSS_BOUNDS.get((name, b["step"]), 1e-3)
            assert b["loss"] == pytest.approx(a["loss"], rel=bound), (name, a, b)
            rel = 1e-6 if exact else BF16_NORM_BOUNDS.get((name, b["step"]), 5e-3)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), (name, a, b)
            assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-6 if exact else 2e-2)
        config = AutoConfig.from_pretrained(str(fp32))
        reference, ours = load_hf_state_dict(str(fp32), config), load_hf_state_dict(str(out), config)
        worst = max(float((ours[k].float() - v).abs().max()) for k, v in reference.items())
        print(f"{name} vs fp32 ZeRO-0 (EP=2) after {STEPS} steps: max |weight diff| {worst:.3g}")
        # About 5x the figure each run measured (docs/measured.md); bf16 rounds weights every step (0.0119-0.0134).
        assert worst < (FP32_WEIGHT_BOUNDS[name] if exact else 0.03), (name, worst)
        biases = [k for k in reference if k.endswith("e_score_correction_bias")]  # balanced: fp32, as fp32's
        if layout.endswith("-balanced"):
            assert any(reference[k].any() for k in biases), "not balanced"
            assert all(ours[k].dtype == torch.float32 and torch.equal(ours[k], reference[k]) for k in biases), name
        if name == "fp32_zero1":  # saved at step 2 (the resume tests' layout): ZeRO-1 shards on every rank
            files = set(os.listdir(out / "global_step2"))
            assert {f"zero_pp_rank_{d}_mp_rank_{s:02d}_optim_states.pt" for d in range(2) for s in range(2)} <= files

    bf16 = tmp_path / "bf16_zero1"
    full = read_jsonl(bf16 / "metrics.jsonl")
    ep1 = read_jsonl(tmp_path / "bf16_zero1_ep1" / "metrics.jsonl")[0]
    assert full[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-3), (full[0], ep1)
    part = tmp_path / "bf16_resumed"
    interrupted_copy(bf16, part, 2)
    check(launch(4, *layout_args(mixtral, converted, sft_data, str(part), resume="true", deepspeed="bf16_zero1")))
    assert_resumed_exactly(bf16, part, 2)

    # Moves: each rank's shard of its experts' state assembled over EP and read into another E, PP and TP
    # (checkpoint/expert_universal.py), continuing the unmoved run's curve: in fp32 to reduction-order noise (and
    # its weights within 1% of lr), in bf16 to bf16 precision. Each keeps the DP size, so each micro-batch holds
    # the same rows: the load-balancing loss is a mean over micro-batches, and other groupings change it.
    moves = {
        "bf16 E 2 -> 1": ("bf16_zero1", mixtral, 4, {"deepspeed": "bf16_zero1", "expert_parallel_size": 1}),
        "fp32 ZeRO-1 DP=4 x E=2 -> E=4 (expert-data groups of 2 -> 1)": (
            "fp32_zero1_dp4",
            "mixtral-dp4-ep2",
            4,
            {"deepspeed.zero_stage": 1, "expert_parallel_size": 4},
        ),
        "fp32 ZeRO-1 PP=2 x DP=2 x E=2 -> PP=1 x DP=2 x E=1": (
            "fp32_zero1",
            mixtral,
            2,
            {"deepspeed.zero_stage": 1, "num_stages": 1, "expert_parallel_size": 1},
        ),
        "fp32 ZeRO-1 TP=2 x DP=2 x E=2 -> PP=2 x DP=2 x E=2 (experts split over TP, merged)": (
            "fp32_zero1_tp2",
            qwen,
            4,
            {"deepspeed.zero_stage": 1, "tensor_parallel_size": 1, "num_stages": 2},
        ),
        "fp32 ZeRO-1 Llama 4 TP=2 x DP=2 x E=2 -> PP=2 x DP=2 x E=1 (x @ W experts)": (
            "fp32_zero1_llama4",
            "llama4-tp2-dp2-ep2",
            4,
            {"deepspeed.zero_stage": 1, "tensor_parallel_size": 1, "num_stages": 2, "expert_parallel_size": 1},
        ),
        "fp32 ZeRO-1 Qwen3.5-MoE TP=2 x DP=2 x E=2 -> PP=2 x DP=2 x E=1 (experts fused on the hub)": (
            "fp32_zero1_qwen3_5_moe",
            "qwen3_5_moe-tp2-dp2-ep2",
            4,
            {"deepspeed.zero_stage": 1, "tensor_parallel_size": 1, "num_stages": 2, "expert_parallel_size": 1},
        ),
        "fp32 ZeRO-1 gpt-oss TP=2 x DP=2 x E=2 -> PP=2 x DP=2 x E=1 (expert biases; whole down biases per TP rank)": (
            "fp32_zero1_gpt_oss",
            "gpt_oss-tp2-dp2-ep2",
            4,
            {"deepspeed.zero_stage": 1, "tensor_parallel_size": 1, "num_stages": 2, "expert_parallel_size": 1},
        ),
    }
    for what, (name, layout, ranks, more) in moves.items():
        full, part = tmp_path / name, tmp_path / f"{name}_moved"
        interrupted_copy(full, part, 2)
        proc = check(launch(ranks, *layout_args(layout, converted, sft_data, str(part), resume="true", **more)))
        assert "global_step2_universal" in proc.stderr, proc.stderr[-3000:]
        expected, got = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        exact = name.startswith("fp32")
        for a, b in zip(expected[2:], got[2:], strict=True):
            assert b["lr"] == a["lr"], (what, a, b)
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5 if exact else 2e-3), (what, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4 if exact else 2e-2), (what, a, b)
        config = AutoConfig.from_pretrained(str(full))
        unmoved, ours = load_hf_state_dict(str(full), config), load_hf_state_dict(str(part), config)
        worst = max(float((ours[k].float() - v.float()).abs().max()) for k, v in unmoved.items())
        print(f"moved {what}: max |weight diff| after {STEPS} steps vs unmoved {worst:.3g}")
        assert worst < MOVE_BOUNDS[name], (what, worst)  # about 5-10x each move's measured figure
    # Each move converted in rank 0's own process (a small checkpoint); a child process writes the same files (the
    # last move's: gpt-oss's experts with their biases).
    child = tmp_path / "child_universal"
    convert_to_universal(str(part / "global_step2"), str(child), experts=True, in_process=False)
    assert_same_files(part / "global_step2_universal", child)


def test_saves_gather_one_sparse_layer_at_a_time(converted, sft_data, tmp_path):
    """A save at EP=2 gathers each sparse layer's experts over the EP group as DeepSpeed writes that layer, not the
    stage's at once (training/expert_parallel.py): the extra memory is one layer's experts, whatever the depth.
    Mixtral PP=2 x DP=2 x EP=2, two sparse layers per stage; the files hold every expert (checked by the resume
    tests above)."""
    out = tmp_path / "records"
    out.mkdir()
    more = dict(max_steps=1, save_steps=1, do_eval="false")
    args = layout_args("mixtral-pp2-dp2-ep2-recompute", converted, sft_data, str(tmp_path / "run"), **more)
    check(torchrun("tests/workers/instrumented_run.py", 4, str(out), *args))
    for rank in range(4):
        rec = json.loads((out / f"rank{rank}.json").read_text())
        if rec["dp_rank"] != 0:  # DeepSpeed writes layer files from DP rank 0 only
            assert rec["gathered_at_save"] == []
            continue
        held = dict(rec["gathered_at_save"])
        blocks = [f"layer_{i:02d}-model_00-model_states.pt" for i in rec["local_layers"] if 1 <= i <= 4]
        assert len(blocks) == 2 and all(held[name] == 1 for name in blocks), held  # Mixtral: every block sparse
        assert max(held.values()) == 1, held


def test_deepseek_zero1_state_moves_across_tp(converted, sft_data, tmp_path, tmp_path_factory):
    """DeepSeek-V3 under fp32 ZeRO-1 at PP=2 x TP=2 (its latent attention split by heads, its experts by rows, its score
    biases balanced every step) equals its fp32 ZeRO-0 run, and its state saved at step 2 moves to PP=2 x TP=1 (the
    universal format merging MLA's heads and the experts' rows) on the unmoved run's curve; the score biases, buffers
    outside the optimizer, carry over bit for bit."""
    from transformers import AutoConfig

    layout = "deepseek_v3-pp2-tp2-balanced"
    fp32 = Path(layout_run(layout, converted, sft_data, tmp_path_factory))
    full, part = tmp_path / "zero1", tmp_path / "moved"
    zero1 = {"deepspeed.zero_stage": 1, "save_steps": 2}
    check(launch(4, *layout_args(layout, converted, sft_data, str(full), **zero1)))
    interrupted_copy(full, part, 2)
    more = {"deepspeed.zero_stage": 1, "tensor_parallel_size": 1, "resume": "true"}
    proc = check(launch(2, *layout_args(layout, converted, sft_data, str(part), **more)))
    assert "global_step2_universal" in proc.stderr, proc.stderr[-3000:]
    config = AutoConfig.from_pretrained(str(fp32))
    reference = load_hf_state_dict(str(fp32), config)
    # about 8x what each measured on an AMD EPYC machine: 3.8e-7, 1.19e-7
    for name, run, start, bound in (("ZeRO-1 vs ZeRO-0", full, 0, 3e-6), ("moved vs unmoved", part, 2, 1e-6)):
        expected = read_jsonl((fp32 if start == 0 else full) / "metrics.jsonl")
        got = read_jsonl(run / "metrics.jsonl")
        assert [m["step"] for m in got] == list(range(1, STEPS + 1))
        for a, b in zip(expected[start:], got[start:], strict=True):
            assert b["lr"] == a["lr"] and b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a, b)
        base = reference if start == 0 else load_hf_state_dict(str(full), config)
        ours = load_hf_state_dict(str(run), config)
        worst = max(float((ours[k] - v).abs().max()) for k, v in base.items())
        print(f"DeepSeek-V3 PP=2 x TP=2 {name}: max |weight diff| after {STEPS} steps {worst:.3g}")
        assert worst < bound, (name, worst)
        biases = [k for k in base if k.endswith("e_score_correction_bias")]
        assert biases and all(torch.equal(ours[k], base[k]) for k in biases), name
