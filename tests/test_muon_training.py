"""`optim.name=muon` through the launcher: 4 ranks as PP x TP x EP x DP equal torch.optim.Muon + AdamW on transformers'
model (tests/muon_reference.py), and its checkpoints resume exactly and move between layouts with the momentum."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint.pipeline_reader import load_hf_state_dict
from tests.conftest import built_once, check, launch, read_jsonl, shared_path
from tests.layouts import LAYOUTS
from tests.resumes import assert_resumed_exactly, interrupted_copy
from tests.test_training import STEPS, assert_matches_reference, layout_args, layout_config

pytestmark = pytest.mark.slow  # launches the trainer on several ranks

# fp32 Newton-Schulz: with torch's bf16 one, 1e-7 relative noise on the reference's own gradients moves its weights by
# up to 0.58% of a tensor's scale in 4 steps (measured); in fp32 by 1.8e-6 (tests/test_muon.py holds the bf16 default
# bit for bit against torch.optim.Muon on the same gradients).
MUON = {"optim.name": "muon", "optim.muon_ns_dtype": "fp32"}
# PP=2 x DP=2 (saved at step 2: the resume and move tests continue it); Mixtral's fused experts over
# PP=2 x DP=2 x EP=2; Phi-3's fused q/k/v and gate/up at PP=2 x TP=2 with sequence parallelism (one matrix per part,
# gathered whole in turns).
MUON_LAYOUTS = ["gqa-pp2-dp2", "mixtral-pp2-dp2-ep2-recompute", "phi3-pp2-tp2"]


def muon_run(layout: str, converted, sft_data, tmp_path_factory) -> str:
    """The 4-rank Muon run of `layout`, once per session."""
    root = shared_path(tmp_path_factory, f"muon_{layout}")
    out = str(root / "run")
    args = layout_args(layout, converted, sft_data, out, **MUON, save_steps=2)
    built_once(root, lambda: check(launch(4, *args)))
    return out


@pytest.mark.parametrize("layout", MUON_LAYOUTS)
def test_muon_matches_torch_muon(layout, hf_models, converted, sft_data, tmp_path_factory):
    """Losses, grad norms, evaluation and weights of 4 steps against torch's Muon on the same global batches: each
    weight within 1e-5 of its tensor's scale (measured at most 2.38e-7 in absolute terms, Mixtral)."""
    variant, _, stages, tp, _, _ = LAYOUTS[layout]
    cfg = layout_config(layout, sft_data)
    cfg.optim.name, cfg.optim.muon_ns_dtype = "muon", "fp32"
    out = muon_run(layout, converted, sft_data, tmp_path_factory)
    dp = 4 // (stages * tp)
    ours, worst = assert_matches_reference(out, cfg, hf_models[variant], sft_data, dp=dp, layout=layout, scale=1e-5)
    print(f"muon parity ({layout}): max |weight diff| after {STEPS} steps = {worst:.3g}")


def test_muon_resumes_exactly_and_moves_with_its_momentum(converted, sft_data, tmp_path, tmp_path_factory):
    """Step 2 of the PP=2 x DP=2 run resumed in the same layout: bit-identical. Moved to PP=4 x DP=1 and to
    PP=2 x TP=2 (the momentum merged and split by each matrix's rule): steps 3-4 on the unmoved run's curve. Resumed
    with optim.name=adamw: refused in one line."""
    from transformers import AutoConfig

    layout = "gqa-pp2-dp2"
    full = Path(muon_run(layout, converted, sft_data, tmp_path_factory))
    expected = read_jsonl(full / "metrics.jsonl")
    config = AutoConfig.from_pretrained(full)
    final = load_hf_state_dict(str(full), config)
    part = tmp_path / "same"
    interrupted_copy(full, part, 2)
    check(launch(4, *layout_args(layout, converted, sft_data, str(part), **MUON, resume="true")))
    assert_resumed_exactly(full, part, 2)  # the saved momentum and Adam moments, bit for bit
    assert all(torch.equal(v, load_hf_state_dict(str(part), config)[k]) for k, v in final.items())
    for name, extra in [
        ("pp4_dp1", {"num_stages": 4, "gradient_accumulation_steps": 6, "model.partition": "[1,1,1,1]"}),
        ("pp2_tp2", {"tensor_parallel_size": 2, "gradient_accumulation_steps": 6}),
    ]:
        part = tmp_path / name
        interrupted_copy(full, part, 2)
        proc = check(launch(4, *layout_args(layout, converted, sft_data, str(part), **MUON, resume="true", **extra)))
        assert "optimizer state reshaped by parameter name" in proc.stdout + proc.stderr
        got = read_jsonl(part / "metrics.jsonl")
        for a, b in zip(expected[2:], got[2:], strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
                a["grad_norm"], rel=1e-4
            ), (name, a, b)
        moved = load_hf_state_dict(str(part), config)
        worst = max(float((moved[k] - v).abs().max()) for k, v in final.items())
        print(f"Muon move PP=2xDP=2 -> {name}: max |weight diff| after {STEPS} steps vs unmoved = {worst:.3g}")
        assert worst < 1e-5, (name, worst)

    # The same checkpoint resumed with AdamW: refused on every rank, in one line, before any state is loaded.
    part = tmp_path / "adamw"
    interrupted_copy(full, part, 2)
    proc = launch(4, *layout_args(layout, converted, sft_data, str(part), resume="true"))
    refused = [line for line in proc.stderr.splitlines() if "saved with optim.name=muon, this run has" in line]
    assert proc.returncode != 0 and refused and "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("layout", ["gqa-pp2-dp2", "phi3-pp2-tp2"])
def test_muon_under_bf16_zero1_follows_the_fp32_run(layout, converted, sft_data, tmp_path, tmp_path_factory):
    """The GPU default (deepspeed=bf16_zero1: bf16 weights, fp32 master weights and gradients, ZeRO-1 over DP;
    DeepSpeed's bf16 optimizer): Muon's momentum is partitioned over DP like Adam's moments, the matrices
    orthogonalised whole from the gathered partitions. Its 4 steps follow the fp32 run of the layout to bf16
    precision (the bounds AdamW's bf16 test holds its first step to); PP=2 x DP=2 resumed at step 2 in its own
    layout is bit-identical, and moved to PP=4 (DeepSpeed's universal checkpoint, the momentum carried) it follows
    the unmoved run to bf16 noise."""
    from tests.resumes import load_checkpoint_file

    fp32 = Path(muon_run(layout, converted, sft_data, tmp_path_factory))
    out = tmp_path / "bf16"
    bf16 = dict(MUON, deepspeed="bf16_zero1", save_steps=2, do_eval="false")
    check(launch(4, *layout_args(layout, converted, sft_data, str(out), **bf16)))
    expected, got = read_jsonl(fp32 / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    for a, b in zip(expected, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=2e-2
        ), (a, b)
    print(f"Muon bf16_zero1 ({layout}): losses {[m['loss'] for m in got]} vs fp32 {[m['loss'] for m in expected]}")
    if layout != "gqa-pp2-dp2":
        return
    # ZeRO-1: each DP rank holds the momentum of its own partition of each Muon group.
    shard = load_checkpoint_file(str(out / "global_step4" / "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"))
    state = shard["optimizer_state_dict"]
    groups = state["base_optimizer_state"]["param_groups"]
    muon = [g for g in groups if g["muon"]]
    assert muon and all(
        set(state["base_optimizer_state"]["state"][i]) == {"momentum_buffer"} for g in muon for i in g["params"]
    )
    part = tmp_path / "same"
    interrupted_copy(out, part, 2)
    check(launch(4, *layout_args(layout, converted, sft_data, str(part), **bf16, resume="true")))
    assert_resumed_exactly(out, part, 2)
    # Moved to PP=4 (DeepSpeed's universal checkpoint, the momentum carried: checkpoint/muon_universal.py): steps 3-4
    # on the unmoved run's curve to bf16 noise, as AdamW's bf16 moves in tests/test_training.py.
    moved = tmp_path / "moved"
    interrupted_copy(out, moved, 2)
    extra = {"num_stages": 4, "gradient_accumulation_steps": 6, "model.partition": "[1,1,1,1]"}
    check(launch(4, *layout_args(layout, converted, sft_data, str(moved), **bf16, resume="true", **extra)))
    momentum = list((moved / "global_step2_universal" / "zero").glob("*/momentum_buffer.pt"))
    assert momentum and not any((path.parent / "exp_avg_sq.pt").exists() for path in momentum)
    assert (moved / "global_step2_universal" / "zero" / "0.weight" / "exp_avg.pt").exists()  # the embedding: AdamW
    for a, b in zip(got[2:], read_jsonl(moved / "metrics.jsonl")[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=2e-2
        ), (a, b)
    # Each matrix's momentum there is its DP partitions' fragments as the bf16 optimizer saved them, joined.
    name = "1.self_attn.q_proj.weight"
    whole = load_checkpoint_file(str(moved / "global_step2_universal" / "zero" / name / "momentum_buffer.pt"))["param"]
    assert whole.abs().max() > 0 and torch.equal(whole.flatten(), saved_momentum(out / "global_step2", name))


def saved_momentum(tag: Path, name: str) -> torch.Tensor:
    """The momentum of `name` (on the first stage, TP=1) as the bf16 optimizer saved it in `tag`: the two files'
    fragments (DP ranks 0 and 1), joined."""
    from tests.resumes import load_checkpoint_file

    pieces = []
    for dp in range(2):
        saved = load_checkpoint_file(str(tag / f"bf16_zero_pp_rank_{dp}_mp_rank_00_optim_states.pt"))
        optim = saved["optimizer_state_dict"]
        for index, mapping in enumerate(optim["param_slice_mappings"]):
            if name in mapping:
                flat = optim["base_optimizer_state"]["state"][index]["momentum_buffer"]
                pieces.append(flat.narrow(0, mapping[name].start, mapping[name].numel))
    return torch.cat(pieces)


def test_lora_with_muon_matches_torch_muon_on_the_adapters(hf_models, tokenizer_dir, sft_data, tmp_path):
    """LoRA's A and B are matrices like any other (each whole, as in PEFT; under TP=2 the split factor gathered):
    PP=2 x TP=2, 4 steps from the Hugging Face directory, equal to torch.optim.Muon on the same adapters of
    transformers' model (the same seeded initial values) within 0.1% of lr."""
    from tests.test_lora import LORA, assert_matches_peft, lora_overrides
    from tests.test_training import overrides, parity_cfg

    cfg = parity_cfg(sft_data[0])
    cfg.lora, cfg.optim.name, cfg.optim.muon_ns_dtype = LORA, "muon", "fp32"
    run = tmp_path / "run"
    args = overrides(cfg, hf_models["gqa"], str(run), 2, tensor_parallel_size=2, **MUON)
    check(launch(4, *args, *lora_overrides()))
    ours = assert_matches_peft(run, cfg, hf_models["gqa"], tokenizer_dir, dp=1, share_of_lr=1e-3)
    assert any(".lora_A" in k for k in ours) and any(".lora_B" in k and v.abs().max() > 0 for k, v in ours.items())


def test_muon_momentum_of_experts_moves_to_another_ep(converted, sft_data, tmp_path, tmp_path_factory):
    """Mixtral's PP=2 x DP=2 x EP=2 run (each rank's experts' momentum saved gathered, fp32 ZeRO-0) resumed at step 2
    with EP=1, every rank holding every expert: steps 3-4 on the unmoved run's curve, weights within 1e-5."""
    from transformers import AutoConfig

    layout = "mixtral-pp2-dp2-ep2-recompute"
    full = Path(muon_run(layout, converted, sft_data, tmp_path_factory))
    part = tmp_path / "ep1"
    interrupted_copy(full, part, 2)
    check(
        launch(4, *layout_args(layout, converted, sft_data, str(part), **MUON, resume="true", expert_parallel_size=1))
    )
    expected, got = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    for a, b in zip(expected[2:], got[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-4
        ), (a, b)
    config = AutoConfig.from_pretrained(full)
    final, moved = load_hf_state_dict(str(full), config), load_hf_state_dict(str(part), config)
    worst = max(float((moved[k] - v).abs().max()) for k, v in final.items())
    print(f"Muon move EP=2 -> EP=1: max |weight diff| after {STEPS} steps vs unmoved = {worst:.3g}")
    assert worst < 1e-5, worst


def test_muon_momentum_of_experts_moves_under_bf16_zero1(converted, sft_data, tmp_path, tmp_path_factory):
    """Mixtral at PP=2 x DP=2 x EP=2 under deepspeed=bf16_zero1 (each rank's shard of its own experts' momentum):
    its 4 steps follow the fp32 run to bf16 precision; resumed at step 2 with EP=1 (the experts' universal checkpoint,
    checkpoint/expert_universal.py, with each expert's momentum assembled whole), steps 3-4 follow the unmoved run."""
    from tests.resumes import load_checkpoint_file

    layout = "mixtral-pp2-dp2-ep2-recompute"
    fp32 = Path(muon_run(layout, converted, sft_data, tmp_path_factory))
    out, moved = tmp_path / "bf16", tmp_path / "ep1"
    bf16 = dict(MUON, deepspeed="bf16_zero1", save_steps=2, do_eval="false")
    check(launch(4, *layout_args(layout, converted, sft_data, str(out), **bf16)))
    got = read_jsonl(out / "metrics.jsonl")
    for a, b in zip(read_jsonl(fp32 / "metrics.jsonl"), got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=2e-2
        ), (a, b)
    interrupted_copy(out, moved, 2)
    check(
        launch(4, *layout_args(layout, converted, sft_data, str(moved), **bf16, resume="true", expert_parallel_size=1))
    )
    # Each expert's momentum whole ([E, ...]): EP rank r's experts as DP rank r saved them (one DP rank per EP rank).
    # Zeroed instead, steps 3-4 moved by 7.3e-5 (relative): the losses alone would not tell.
    name = "1.mlp.experts.gate_up_proj"
    experts = load_checkpoint_file(str(moved / "global_step2_universal" / "zero" / name / "momentum_buffer.pt"))
    assert experts["is_expert_param"] and experts["param"].shape[0] == 4
    assert not (moved / "global_step2_universal" / "zero" / name / "exp_avg_sq.pt").exists()
    assert all(float(e.abs().max()) > 0 for e in experts["param"])
    assert torch.equal(experts["param"].flatten(), saved_momentum(out / "global_step2", name))
    for a, b in zip(got[2:], read_jsonl(moved / "metrics.jsonl")[2:], strict=True):  # the same bf16 run moved
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-4) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=1e-2
        ), (a, b)
    print(f"Muon bf16 EP=2 -> EP=1: losses {[m['loss'] for m in read_jsonl(moved / 'metrics.jsonl')]} vs {got}")
