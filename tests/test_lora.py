"""LoRA: pipeline training matches a single-process PEFT reference; adapters merge to PEFT's logits."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from checkpoint.layer_files import find_layer_file, load_layer_state
from schema.model import LoraSettings
from tests.baseline import train_baseline
from tests.conftest import FAMILY_VARIANTS, MOE_VARIANTS, check, launch, read_jsonl, run_cmd
from tests.resumes import assert_resumed_exactly, interrupted_copy
from tests.test_training import overrides, parity_cfg

LORA = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_overrides() -> list[str]:
    targets = "[" + ",".join(LORA.target_modules) + "]"
    return ["lora.enabled=true", f"lora.r={LORA.r}", f"lora.alpha={LORA.alpha}", f"lora.target_modules={targets}"]


def adapter_state(run_dir, config) -> dict[str, torch.Tensor]:
    """Our adapter weights under PEFT's key names (tensor-parallel shards merged)."""
    from checkpoint.layer_files import checkpoint_tp_size, load_layer_whole
    from models.pipe_layout import pipe_layers

    step_dir = os.path.join(run_dir, (run_dir / "latest").read_text())
    out = {}
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)[1 : config.num_hidden_layers + 1]:
        for key, value in load_layer_whole(
            step_dir, layer, config.vocab_size, checkpoint_tp_size(step_dir), config
        ).items():
            out[f"base_model.model.model.layers.{layer.block}.{key}"] = value
    return out


def adam_moments(step_dir) -> dict[str, torch.Tensor]:
    """{"name:exp_avg" / "name:exp_avg_sq": tensor} over every engine file of a ZeRO-0 checkpoint, by the parameter
    names saved beside the optimizer state (the pipeline's global layer indices: the same in any layout)."""
    from checkpoint.safe_load import load_pt

    out = {}
    for path in sorted(step_dir.glob("mp_rank_*_model_states.pt")):
        saved = load_pt(str(path))
        optim = saved["optimizer"]
        for group, names in zip(optim["param_groups"], saved["optimizer_param_names"], strict=True):
            for index, name in zip(group["params"], names, strict=True):
                for moment in ("exp_avg", "exp_avg_sq"):
                    out.setdefault(f"{name}:{moment}", optim["state"][index][moment])
    return out


def assert_matches_peft(
    run, cfg, hf_dir: str, tokenizer_dir: str, dp: int, share_of_lr: float = 0.01
) -> dict[str, torch.Tensor]:
    """The run's losses, grad norms and adapters against PEFT trained in one process on the same global batches,
    the adapters within `share_of_lr` x lr. Returns our adapters under PEFT's names (TP shards merged)."""
    from transformers import AutoConfig

    ref_model, ref_losses, ref_norms = train_baseline(hf_dir, tokenizer_dir, cfg, dp=dp, steps=cfg.max_steps)
    metrics = read_jsonl(run / "metrics.jsonl")
    assert any(n > cfg.optim.max_grad_norm > 0 for n in ref_norms), ("clipping never engaged", ref_norms)
    torch.testing.assert_close(
        torch.tensor([m["loss"] for m in metrics]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        torch.tensor([m["grad_norm"] for m in metrics]), torch.tensor(ref_norms), rtol=1e-4, atol=1e-6
    )
    saved = adapter_state(run, AutoConfig.from_pretrained(run))
    ours = {k: v for k, v in saved.items() if ".lora_" in k}
    buffers = {f"base_model.model.{k}" for k, _ in ref_model.named_buffers()}
    assert set(saved) - set(ours) <= buffers, sorted(set(saved) - set(ours) - buffers)  # e.g. DeepSeek's score biases
    ref = {f"base_model.model.{k}": v for k, v in ref_model.state_dict().items() if ".lora_" in k}
    assert set(ours) == set(ref)
    for key in ref:
        if share_of_lr == 0.01:  # (the pages quote this assertion)
            torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=0.01 * cfg.learning_rate)
        else:
            torch.testing.assert_close(ours[key], ref[key], rtol=1e-5, atol=share_of_lr * cfg.learning_rate)
    return ours


def peft_model(hf_dir: str, adapters: dict[str, torch.Tensor] | None = None, targets: list[str] | None = None):
    """PEFT's model of `hf_dir` with `adapters` (PEFT's names). Where `get_peft_model` refuses the targets (a model
    with fused experts and `gate_proj` targeted without `up_proj`: its conversion would adapt the fused experts), the
    adapters are injected into each decoder layer (PEFT's `inject_adapter_in_model`, as models/lora.py does)."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, target_modules=targets or LORA.target_modules)
    try:
        model = get_peft_model(base, config)
    except ValueError as e:
        assert "Cannot convert PEFT target" in str(e), e
        for layer in base.model.layers:
            inject_adapter_in_model(config, layer)
        model = base
        adapters = {k.removeprefix("base_model.model."): v for k, v in adapters.items()} if adapters else adapters
    if adapters is not None:
        missing = model.load_state_dict(adapters, strict=False)
        assert not missing.unexpected_keys
    return model.eval()


def assert_merged_export_is_peft(run, hf_dir: str, adapters: dict, targets: list[str], out) -> None:
    """`--to-hf --merge-lora` of the run gives the logits of PEFT's unmerged model with the run's adapters."""
    from transformers import AutoModelForCausalLM

    export = [sys.executable, "convert2ckpt.py", "--to-hf", "--input", str(run), "--output", str(out), "--merge-lora"]
    check(run_cmd(export))
    merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(
            merged(ids).logits, peft_model(hf_dir, adapters, targets)(ids).logits, rtol=1e-5, atol=1e-5
        )


def assert_peft_export_is_the_run(run, hf_dir: str, out) -> None:
    """`--to-peft` of the run, loaded by PEFT (`PeftModel.from_pretrained` on the Hugging Face base, every adapter
    from the file): its logits equal the trainer's model (the run's checkpoint, adapters merged on load) and
    `--to-hf --merge-lora`'s export within 1e-5; the config names the base the run started from."""
    import json

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from checkpoint.hf_model import load_causal_lm

    check(run_cmd([sys.executable, "convert2ckpt.py", "--to-peft", "--input", str(run), "--output", str(out / "peft")]))
    check(
        run_cmd(
            [
                sys.executable,
                "convert2ckpt.py",
                "--to-hf",
                "--input",
                str(run),
                "--output",
                str(out / "merged"),
                "--merge-lora",
            ]
        )
    )
    conf = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == hf_dir and conf["peft_type"] == "LORA", conf
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(out / "peft")).eval()
    saved = load_file(str(out / "peft" / "adapter_model.safetensors"))
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(saved) and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    merged = AutoModelForCausalLM.from_pretrained(str(out / "merged"), dtype=torch.float32).eval()
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(logits, load_causal_lm(str(run))(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits, merged(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_lora_pipeline_training_matches_peft_reference_and_merges(
    hf_models, converted, tokenizer_dir, sft_data, tmp_path
):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = parity_cfg(sft_data[0])
    cfg.lora = LORA
    run = tmp_path / "run"
    args = overrides(cfg, converted["gqa"], str(run), 2, save_steps=2)
    check(launch(4, *args, *lora_overrides()))
    ours = assert_matches_peft(run, cfg, hf_models["gqa"], tokenizer_dir, dp=2)
    assert len(ours) == 4 * 3 * 2  # layers x targets x (A, B)
    metrics = read_jsonl(run / "metrics.jsonl")
    # Only the adapter is saved: other layer files are empty, base weights are never written.
    step = run / "global_step4"
    assert load_layer_state(find_layer_file(str(step), 0)) == {}
    assert all(".lora_" in k for k in load_layer_state(find_layer_file(str(step), 1)))

    # Merged export == PEFT's unmerged adapter model.
    merged_dir = tmp_path / "merged"
    proc = run_cmd(
        [sys.executable, "convert2ckpt.py", "--to-hf", "--input", str(run), "--output", str(merged_dir), "--merge-lora"]
    )
    assert proc.returncode == 0, proc.stderr
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    unmerged = peft_model(hf_models["gqa"], ours)
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, unmerged(ids).logits, rtol=1e-5, atol=1e-5)

    # Resume (same layout) loads the base, then the adapter and its optimizer state.
    part = tmp_path / "part"
    interrupted_copy(run, part, 2)
    check(launch(4, *overrides(cfg, converted["gqa"], str(part), 2, save_steps=2, resume="true"), *lora_overrides()))
    assert_resumed_exactly(run, part, 2)  # the steps it trained, the adapters and their Adam moments
    # ... and in another layout (PP=1 x DP=2): adapter and its Adam moments reshaped by name.
    moved = tmp_path / "moved"
    interrupted_copy(run, moved, 2)
    args = overrides(cfg, converted["gqa"], str(moved), 1, save_steps=2, resume="true")
    check(launch(2, *args, *lora_overrides()))
    got = read_jsonl(moved / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in metrics]
    for a, b in zip(metrics[2:], got[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and a["lr"] == b["lr"], (a, b)
    # The adapters and their Adam moments after the moved run's own steps, against the unmoved run's.
    config = AutoConfig.from_pretrained(run)
    want, have = adapter_state(run, config), adapter_state(moved, config)
    moments, moved_moments = adam_moments(run / "global_step4"), adam_moments(moved / "global_step4")
    assert want.keys() == have.keys() and moments.keys() == moved_moments.keys() and len(moments) == 2 * len(want)
    adapters = max(float((want[k] - have[k]).abs().max()) for k in want)
    first = max(float((moments[k] - moved_moments[k]).abs().max()) for k in moments if k.endswith(":exp_avg"))
    second = max(float((moments[k] - moved_moments[k]).abs().max()) for k in moments if k.endswith("_sq"))
    print(f"LoRA moved PP=2 -> PP=1: adapters {adapters:.3g}, exp_avg {first:.3g}, exp_avg_sq {second:.3g} apart")
    assert adapters < 1e-7 and first < 2e-8 and second < 3e-9  # measured 7.45e-9, 1.86e-9, 2.33e-10


@pytest.mark.slow
@pytest.mark.parametrize("schedule,tp,cp", [("zero_bubble", 2, 1), ("dualpipev", 1, 1), ("1f1b", 1, 2)])
def test_lora_under_each_pipeline_schedule_matches_peft(schedule, tp, cp, hf_models, tokenizer_dir, sft_data, tmp_path):
    """LoRA's A and B weight gradients deferred to W passes under PP=2 x TP=2 (zero_bubble; A of a column layer,
    whose gradient is summed over TP, stays with autograd), adapters on the two stages each rank holds
    (dualpipev), and adapters under PP=2 x CP=2 (Ulysses): 4 AdamW steps with clipping equal PEFT's single-process
    training, as under 1F1B."""

    cfg = parity_cfg(sft_data[0])
    cfg.lora = LORA
    cfg.gradient_accumulation_steps = 4  # DualPipeV needs 2 x PP micro-batches
    run = tmp_path / "run"
    # From the Hugging Face directory: each rank converts the layers it holds at load (DualPipeV: two stages).
    args = overrides(cfg, hf_models["gqa"], str(run), 2, pipeline_schedule=schedule, tensor_parallel_size=tp)
    check(launch(2 * tp * cp, *args, f"context_parallel_size={cp}", *lora_overrides()))
    assert_matches_peft(run, cfg, hf_models["gqa"], tokenizer_dir, dp=1)
    if tp == 2:  # the adapters as a PEFT directory, TP shards joined
        assert_peft_export_is_the_run(run, hf_models["gqa"], tmp_path)


@pytest.mark.slow
def test_lora_on_a_model_with_experts_matches_peft(hf_models, converted, tokenizer_dir, sft_data, tmp_path):
    """Mixtral (4 experts, top-2, the load-balancing loss on) with adapters on attention, PP=2 x DP=2 with the frozen
    experts split over EP=2: 4 AdamW steps with clipping equal PEFT on transformers' model trained per micro-batch;
    only adapters are saved (the frozen experts' per-expert keys left out of every layer file); in bf16 the same
    losses and grad norms to bf16 precision."""
    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "o_proj"])
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", "lora.target_modules=[q_proj,v_proj,o_proj]"]
    check(launch(4, *overrides(cfg, converted["mixtral"], str(run), 2, expert_parallel_size=2), *lora))
    ours = assert_matches_peft(run, cfg, hf_models["mixtral"], tokenizer_dir, dp=2)
    assert len(ours) == 4 * 3 * 2  # layers x targets x (A, B)
    assert all(".lora_" in k for k in load_layer_state(find_layer_file(str(run / "global_step4"), 1)))
    assert_peft_export_is_the_run(run, hf_models["mixtral"], tmp_path)  # (from a converted checkpoint)
    # The GPU default (bf16, DeepSpeed's bf16 optimizer over the adapters; the frozen experts, split over EP=2, are
    # broadcast within their expert-data group and never reduced): the same run to bf16 precision.
    bf16 = tmp_path / "bf16"
    more = dict(expert_parallel_size=2, deepspeed="bf16_zero1")
    check(launch(4, *overrides(cfg, converted["mixtral"], str(bf16), 2, **more), *lora))
    for a, b in zip(read_jsonl(run / "metrics.jsonl"), read_jsonl(bf16 / "metrics.jsonl"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3) and b["grad_norm"] == pytest.approx(
            a["grad_norm"], rel=2e-2
        ), (a, b)


@pytest.mark.slow
def test_lora_on_latent_attention_matches_peft(hf_models, converted, tokenizer_dir, sft_data, tmp_path):
    """DeepSeek-V3 (multi-head latent attention; its first layer dense, the others' experts frozen and split over
    EP=2) with adapters on every projection of its attention, low-rank ones included, and on `gate_proj` and
    `down_proj`: the first layer's dense MLP and the others' shared experts. PP=2 x DP=2, 4 AdamW steps with clipping
    equal PEFT's single-process training; the merged export equals PEFT's unmerged model."""

    targets = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "down_proj"]
    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=targets)
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", f"lora.target_modules=[{','.join(targets)}]"]
    check(launch(4, *overrides(cfg, converted["deepseek_v3"], str(run), 2, expert_parallel_size=2), *lora))
    ours = assert_matches_peft(run, cfg, hf_models["deepseek_v3"], tokenizer_dir, dp=2)
    assert len(ours) == 4 * len(targets) * 2  # layers x targets x (A, B)
    assert_merged_export_is_peft(run, hf_models["deepseek_v3"], ours, targets, tmp_path / "merged")


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,targets",
    [
        ("gpt_oss", ["q_proj", "k_proj", "v_proj", "o_proj"]),
        ("glm4_moe", ["q_proj", "v_proj", "gate_proj", "down_proj"]),
        # its low-rank query, its grouped output's second projection and its shared experts, its streams and the
        # tokens to its hash layers across the cut
        ("deepseek_v4", ["q_a_proj", "q_b_proj", "o_b_proj", "up_proj", "down_proj"]),
        # both its attentions' q/o (its delta attention's short convolutions frozen, three tensors in its layer files)
        ("kimi_linear", ["q_proj", "o_proj", "down_proj"]),
    ],
)
def test_lora_with_experts_matches_peft(variant, targets, hf_models, converted, tokenizer_dir, sft_data, tmp_path):
    """gpt-oss (sinks, biased q/k/v/o, every layer sparse), GLM-4.5 (biased q/k/v; its first layer's dense MLP and
    the others' shared experts) and DeepSeek-V4, experts frozen and split over EP=2, at PP=2 x DP=2: 4 AdamW steps
    with clipping equal PEFT's single-process training; the merged export equals PEFT's unmerged model."""
    from transformers import AutoConfig

    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=targets)
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", f"lora.target_modules=[{','.join(targets)}]"]
    check(launch(4, *overrides(cfg, converted[variant], str(run), 2, expert_parallel_size=2), *lora))
    ours = assert_matches_peft(run, cfg, hf_models[variant], tokenizer_dir, dp=2)
    layers = AutoConfig.from_pretrained(hf_models[variant]).num_hidden_layers
    assert len(ours) == layers * len(targets) * 2  # layers x targets x (A, B): every layer has each target
    assert_merged_export_is_peft(run, hf_models[variant], ours, targets, tmp_path / "merged")


@pytest.mark.slow
def test_lora_on_linear_attention_matches_peft(hf_models, converted, tokenizer_dir, sft_data, tmp_path):
    """Qwen3.5 (Gated DeltaNet linear attention in layers 0-2, gated full attention in layer 3) with adapters on both
    kinds of attention and the MLP, at PP=2 x TP=2: q/k/v in one linear-attention projection (its B split part by
    part, its A replicated with the gradient summed over TP), z by rows, out_proj and down_proj row-parallel. 4 AdamW
    steps with clipping equal PEFT's single-process training; the merged export equals PEFT's unmerged model."""
    targets = ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "out_proj", "down_proj"]
    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=targets)
    cfg.optim.max_grad_norm = 0.3  # this model's adapter gradients: norms 0.33-0.41, so clipping engages
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", f"lora.target_modules=[{','.join(targets)}]"]
    check(launch(4, *overrides(cfg, converted["qwen3_5"], str(run), 2, tensor_parallel_size=2), *lora))
    ours = assert_matches_peft(run, cfg, hf_models["qwen3_5"], tokenizer_dir, dp=1)
    # 3 linear-attention layers (in_proj_qkv, in_proj_z, out_proj, down_proj), 1 full (q_proj, v_proj, down_proj)
    assert len(ours) == (3 * 4 + 3) * 2
    assert_merged_export_is_peft(run, hf_models["qwen3_5"], ours, targets, tmp_path / "merged")


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gqa", *FAMILY_VARIANTS, "qwen3_5_moe"])
def test_merge_peft_adapter_directory_into_checkpoint_or_hf(variant, hf_models, converted, tmp_path):
    """A PEFT adapter directory merged into a pipeline checkpoint or an HF directory gives PEFT's logits (with experts:
    adapters on attention; PEFT puts `down_proj` on the fused experts' parameters, which merging refuses)."""
    adapter_dir = tmp_path / "adapter"
    moe = variant in MOE_VARIANTS
    mla = variant in ("deepseek_v3", "mistral4", "glm4_moe_lite")
    attention = ["q_b_proj", "kv_b_proj", "o_proj"] if mla else ["q_proj", "v_proj"]  # MLA's
    model = peft_model(hf_models[variant], targets=attention if moe else None)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # PEFT initialises B to zero; make the adapter do something
    model.save_pretrained(str(adapter_dir))
    ids = torch.randint(3, 60, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    from transformers import AutoModelForCausalLM

    for name, source in [("from_ckpt", converted[variant]), ("from_hf", hf_models[variant])]:
        out = tmp_path / name
        proc = run_cmd(
            [
                sys.executable,
                "convert2ckpt.py",
                "--to-hf",
                "--input",
                source,
                "--output",
                str(out),
                "--merge-lora",
                str(adapter_dir),
            ]
        )
        assert proc.returncode == 0, proc.stderr
        merged = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".merge-base-")]


PEFT_SETTINGS = {
    "alpha_pattern": {"alpha_pattern": {"v_proj": 32}},
    "rank_pattern": {"rank_pattern": {"q_proj": 2, "model.layers.1.mlp.down_proj": 6}},
    "rslora": {"use_rslora": True},
    "all_three": {"rank_pattern": {"v_proj": 8}, "alpha_pattern": {"layers.2.self_attn.q_proj": 3}, "use_rslora": True},
    "adapter_model.bin": {},  # PEFT's older format (torch.save), read through the safe loader
}


@pytest.mark.parametrize("setting", list(PEFT_SETTINGS))
def test_peft_adapter_settings_merge_exactly(setting, hf_models, converted, tmp_path):
    """rank_pattern, alpha_pattern and use_rslora: the merged export equals PEFT's own merge_and_unload()."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from checkpoint.export import export_pipeline_to_hf

    base = AutoModelForCausalLM.from_pretrained(hf_models["gqa"], dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **PEFT_SETTINGS[setting])
    model = get_peft_model(base, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.1)
    legacy = setting == "adapter_model.bin"
    model.save_pretrained(str(tmp_path / "adapter"), safe_serialization=not legacy)
    assert (tmp_path / "adapter" / setting).exists() or not legacy
    expected = model.merge_and_unload().state_dict()
    export_pipeline_to_hf(
        converted["gqa"], str(tmp_path / "merged"), merge_lora=str(tmp_path / "adapter"), log=lambda *_: None
    )
    merged = load_file(str(tmp_path / "merged" / "model-00001-of-00001.safetensors"))
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert torch.equal(merged[key], value), key  # bit-identical to PEFT's merge
    original = AutoModelForCausalLM.from_pretrained(hf_models["gqa"], dtype=torch.float32).state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], original[q])


@pytest.mark.parametrize(
    "field,value",
    [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"]), ("lora_bias", True), ("peft_type", "IA3")],
)
def test_adapters_that_are_not_plain_lora_are_refused(field, value, hf_models, converted, tmp_path, capsys):
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import convert2ckpt

    base = AutoModelForCausalLM.from_pretrained(hf_models["gqa"], dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(str(tmp_path / "a"))
    conf_path = tmp_path / "a" / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    conf[field] = value
    conf_path.write_text(json.dumps(conf))
    capsys.readouterr()  # what loading the models above printed
    code = convert2ckpt.main(
        ["--to-hf", "--input", converted["gqa"], "--output", str(tmp_path / "out"), "--merge-lora", str(tmp_path / "a")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err  # one line
    assert err[0].startswith("convert2ckpt: error:") and f"{field}=" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("stages,tp", [(2, 1), (1, 2)])
def test_lora_on_linear_attention_with_experts_matches_peft(stages, tp, hf_models, converted, sft_data, tmp_path):
    """Qwen3.5-MoE (Gated DeltaNet linear attention in layers 0-2 and gated full attention in layer 3, a sparse block
    in every layer, its experts fused and frozen, split over EP=2, the load-balancing loss on) with adapters on both
    kinds of attention and the shared expert's up and down projections, PP=2 x DP=2 and TP=2 x DP=2 (the shared
    expert split as a dense MLP, its adapters' gradients summed over TP as a dense MLP's): 4 AdamW steps with clipping
    equal PEFT's single-process training; the merged export equals PEFT's unmerged model."""
    targets = ["q_proj", "v_proj", "in_proj_qkv", "in_proj_z", "out_proj", "up_proj", "down_proj"]
    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=targets)
    cfg.optim.max_grad_norm = 0.1  # this model's adapter gradients: norms 0.15-0.30 (by the suite's seed): clipped
    run = tmp_path / "run"
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", f"lora.target_modules=[{','.join(targets)}]"]
    more = dict(expert_parallel_size=2, tensor_parallel_size=tp)
    check(launch(4, *overrides(cfg, converted["qwen3_5_moe"], str(run), stages, **more), *lora))
    # The tokenizer as the trainer loads it: the class config.json's model_type names (Qwen2Tokenizer here).
    # Adapters within 2% of lr: at PP=2 one element of layer 0's in_proj_z A is 1.14% of lr from PEFT's (every other
    # adapter 0.11% or less; TP=2 within 1%), as one element of GLM-4.5's experts is (docs/measured.md).
    ours = assert_matches_peft(run, cfg, hf_models["qwen3_5_moe"], hf_models["qwen3_5_moe"], dp=2, share_of_lr=0.02)
    # 3 linear-attention layers (in_proj_qkv, in_proj_z, out_proj, up_proj, down_proj), 1 full (q, v, up, down)
    assert len(ours) == (3 * 5 + 4) * 2
    assert_merged_export_is_peft(run, hf_models["qwen3_5_moe"], ours, targets, tmp_path / "merged")
