"""QLoRA (`lora.quantize=nf4`): the frozen base's decoder linears held as bitsandbytes NF4 (models/nf4.py) compute as
bitsandbytes' own layer and as transformers' 4-bit model; pipeline training equals PEFT + bitsandbytes in one process
and plain LoRA on the NF4-round-tripped base."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from models.frozen_weights import held_bytes
from models.nf4 import NF4Weight, nf4_bytes, quantize_linear, quantize_stage, require_bitsandbytes
from tests.conftest import check, launch, read_jsonl
from tests.resumes import assert_resumed_exactly, interrupted_copy
from tests.test_lora import LORA, assert_matches_peft, lora_overrides
from tests.test_training import overrides, parity_cfg

pytest.importorskip("bitsandbytes")

NF4 = ["lora.quantize=nf4"]


@pytest.mark.parametrize("double", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_linear_is_bitsandbytes_linear4bit(double, dtype):
    """Forward and the input's gradient bit-identical to bitsandbytes' Linear4bit (training mode), with a bias and
    double quantization; the bytes held are `nf4_bytes`; a cast of the module to bf16 (DeepSpeed's) changes nothing."""
    import bitsandbytes as bnb

    torch.manual_seed(0)
    linear = nn.Linear(128, 96).to(dtype)
    ref = bnb.nn.Linear4bit(128, 96, compute_dtype=dtype, compress_statistics=double, quant_type="nf4")
    ref.weight = bnb.nn.Params4bit(linear.weight.data.clone(), False, compress_statistics=double, quant_type="nf4")
    ref.bias = nn.Parameter(linear.bias.data.clone())
    ref = ref.to("cpu").train()  # (quantizes)
    quantize_linear(linear, double)
    assert isinstance(linear.weight, NF4Weight) and isinstance(linear, nn.Linear)
    x = torch.randn(3, 5, 128, dtype=dtype, requires_grad=True)
    want = ref(x)
    (want_grad,) = torch.autograd.grad(want.square().sum(), [x])
    for _ in range(2):  # before and after the cast
        have = linear(x)
        (have_grad,) = torch.autograd.grad(have.square().sum(), [x])
        assert torch.equal(have, want) and torch.equal(have_grad, want_grad)
        linear.weight.bfloat16()  # (the bias is the run's: cast with it)
    assert held_bytes(linear) - linear.bias.numel() * linear.bias.element_size() == nf4_bytes(128 * 96, double)
    assert nf4_bytes(4096 * 4096) * 8 / (4096 * 4096) == pytest.approx(4.5, abs=1e-3)  # the planner's 4.5 bits


@pytest.mark.parametrize("variant", ["llama3", "qwen2", "mixtral", "gemma3"])
def test_quantized_stage_is_transformers_4bit_model(variant, hf_models):
    """`quantize_stage` on a transformers model loaded whole holds the layers transformers' BitsAndBytesConfig
    converts (the same ones, the same codes), so the logits are bit-identical to transformers' own 4-bit model."""
    from tests.baseline import hf_model, quantized

    cfg = parity_cfg("unused")
    cfg.lora = dataclasses.replace(LORA, quantize="nf4")
    four_bit = hf_model(hf_models[variant], dtype=torch.float32, **quantized(cfg)).train()
    ours = hf_model(hf_models[variant], dtype=torch.float32).train()
    count = quantize_stage(ours, experts=False)  # (transformers' bitsandbytes model leaves the experts)
    import bitsandbytes as bnb

    assert count == sum(isinstance(m, bnb.nn.Linear4bit) for m in four_bit.modules()) > 0
    ids = torch.randint(3, 60, (2, 12))
    assert torch.equal(ours(ids).logits, four_bit(ids).logits)


def test_nf4_refusals(monkeypatch, hf_models, tmp_path, capsys):
    """Without LoRA, without bitsandbytes, an unknown value: one line naming the key."""
    import sys

    from schema.checks import check_config

    cfg = parity_cfg("unused")
    cfg.model_name_or_path = "x"
    cfg.lora = dataclasses.replace(LORA, enabled=False, quantize="nf4")
    with pytest.raises(ValueError, match=r"lora.quantize=nf4 needs lora.enabled=true"):
        check_config(cfg)
    cfg.lora = dataclasses.replace(LORA, quantize="int3")
    with pytest.raises(ValueError, match=r"lora.quantize=int3 must be none or nf4"):
        check_config(cfg)
    cfg.lora = dataclasses.replace(LORA, quantize_double=True)
    with pytest.raises(ValueError, match=r"lora.quantize_double=true needs lora.quantize=nf4"):
        check_config(cfg)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(ValueError, match=r"^lora.quantize=nf4 needs bitsandbytes"):
        require_bitsandbytes()


def round_trip(model: nn.Module, experts: bool = True) -> nn.Module:
    """`model` quantized as the trainer quantizes a stage (`quantize_stage`, with `experts` the experts too), then
    every NF4 weight dequantized back into a plain fp32 parameter: the dense base QLoRA computes with."""
    quantize_stage(model, experts=experts)
    with torch.no_grad():
        for module in list(model.modules()):
            for name in getattr(module, "held_weights", []):  # fused experts
                setattr(module, name, nn.Parameter(getattr(module, f"{name}_held").dequantize(torch.float32), False))
                delattr(module, f"{name}_held")
            if hasattr(module, "held_weights"):
                module.held_weights = []  # (its hooks then do nothing)
            if isinstance(module.__dict__.get("_modules", {}).get("weight"), NF4Weight):
                weight = module.weight.dequantize(torch.float32)
                del module.weight
                module.weight = nn.Parameter(weight)
                module.__class__ = nn.Linear if type(module).__mro__[1] is nn.Linear else type(module).__mro__[1]
    return model


def _round_tripped(hf_dir: str, out, experts: bool = True) -> str:
    """`hf_dir` with its NF4-held weights replaced by their round trip (`round_trip`), saved."""
    from tests.baseline import hf_model

    round_trip(hf_model(hf_dir, dtype=torch.float32), experts).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("variant", ["mixtral", "qwen2_moe", "llama4", "llama4-routed", "gpt_oss", "deepseek_v3"])
def test_nf4_experts_compute_with_their_round_trip(variant, hf_models):
    """A model with experts quantized as the trainer does (its experts too: each call of the sparse block
    dequantizes them) gives the logits and input gradients of its NF4-round-tripped dense copy, bit for bit, and holds
    its experts as NF4 only; Llama 4's also with its experts run on their routed tokens (`moe.routed_experts`, as
    expert parallelism runs them: transformers' experts functions called on the module, not the module)."""
    from models.expert_parallel import ExpertParallel
    from tests.baseline import hf_model

    def built():
        model = hf_model(hf_models[variant.split("-")[0]], dtype=torch.float32).train()
        if variant.endswith("-routed"):
            for layer in model.model.layers:
                if hasattr(layer.feed_forward, "experts"):  # (the split builds the router anew: its weights back)
                    router = layer.feed_forward.router.state_dict()
                    ExpertParallel().split(layer.feed_forward, model.config, routed=True)
                    layer.feed_forward.router.load_state_dict(router)
        return model

    ours = built()
    quantize_stage(ours)
    dense = round_trip(built())
    experts = [m for m in ours.modules() if hasattr(m, "held_weights")]
    assert experts and all(not any(p.dim() == 3 for p in m.parameters(recurse=False)) for m in experts)
    ids = torch.randint(3, 60, (2, 12))
    outs = []
    for model in (ours, dense):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeds).logits
        (grad,) = torch.autograd.grad(logits.square().sum(), [embeds])
        outs.append((logits, grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert all(n not in m.__dict__ for m in experts for n in m.held_weights)  # the dense copies dropped after use


@pytest.mark.slow
@pytest.mark.parametrize("variant,stages,tp", [("gqa", 2, 1), ("llama3", 2, 2)])
def test_qlora_pipeline_training_matches_peft_with_bitsandbytes(
    variant, stages, tp, hf_models, converted, tokenizer_dir, sft_data, tmp_path
):
    """QLoRA at PP=2 x DP=2 (from a converted checkpoint) and PP=2 x TP=2 under zero_bubble (Llama 3.1's biases and
    128-wide projections, each row layer's shard 64 columns: its blocks are the whole weight's), 4 AdamW steps with
    clipping: losses, grad norms and adapters equal PEFT trained on transformers' 4-bit model in one process (its
    bitsandbytes LoRA layers), and plain LoRA on the NF4-round-tripped dense base; the unquantized base's loss is
    not theirs (the control). At PP=2 x DP=2 also: a resume (the base quantized again) trains the same steps, bf16
    ZeRO-1 follows fp32, and `--to-peft`'s adapters on transformers' 4-bit base give the reference's logits."""
    from tests.baseline import train_baseline

    cfg = parity_cfg(sft_data[0])
    cfg.lora = dataclasses.replace(LORA, quantize="nf4")
    run = tmp_path / "run"
    source = converted[variant] if tp == 1 else hf_models[variant]
    schedule = "zero_bubble" if tp > 1 else "1f1b"  # (its deferred weight gradients pass the NF4 layers by)
    args = overrides(cfg, source, str(run), stages, tensor_parallel_size=tp, save_steps=2, pipeline_schedule=schedule)
    check(launch(4, *args, *lora_overrides(), *NF4))
    dp = 4 // (stages * tp)
    ours = assert_matches_peft(run, cfg, hf_models[variant], tokenizer_dir, dp=dp)  # PEFT + bitsandbytes
    plain = dataclasses.replace(cfg, lora=LORA)
    assert_matches_peft(run, plain, _round_tripped(hf_models[variant], tmp_path / "nf4_dense"), tokenizer_dir, dp=dp)
    metrics = read_jsonl(run / "metrics.jsonl")
    _, dense, _ = train_baseline(hf_models[variant], tokenizer_dir, plain, dp=dp, steps=1)
    print(f"QLoRA {variant} PP={stages} x TP={tp}: step 1 loss {metrics[0]['loss']:.7f}, dense base {dense[0]:.7f}")
    assert abs(metrics[0]["loss"] - dense[0]) > 1e-4 * dense[0]  # (NF4 moves it: the comparisons above can tell)
    assert json.loads((run / "lora.json").read_text())["quantize"] == "nf4"
    if tp > 1:
        return
    part = tmp_path / "part"
    interrupted_copy(run, part, 2)
    more = dict(tensor_parallel_size=tp, save_steps=2, resume="true")
    check(launch(4, *overrides(cfg, source, str(part), stages, **more), *lora_overrides(), *NF4))
    assert_resumed_exactly(run, part, 2)
    bf16 = tmp_path / "bf16"
    check(launch(4, *overrides(cfg, source, str(bf16), stages, deepspeed="bf16_zero1"), *lora_overrides(), *NF4))
    for a, b in zip(metrics, read_jsonl(bf16 / "metrics.jsonl"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-3), (a, b)
    assert_serves_on_a_4bit_base(run, cfg, hf_models[variant], ours, tmp_path)


@pytest.mark.slow
def test_qlora_with_nf4_experts_matches_lora_on_their_round_trip(
    hf_models, converted, tokenizer_dir, sft_data, tmp_path
):
    """Mixtral (4 experts, top-2, the load-balancing loss on) at PP=2 x DP=2 x EP=2, every block recomputed, its
    experts in NF4 too (each EP rank its own experts): 4 AdamW steps with clipping equal plain LoRA on the
    NF4-round-tripped dense base (experts included) in one process, by LoRA's bounds; without recompute the run is
    refused in one line."""
    from tests.baseline import train_baseline

    cfg = parity_cfg(sft_data[0])
    cfg.lora = dataclasses.replace(LORA, quantize="nf4", target_modules=["q_proj", "v_proj"])
    targets = [
        "lora.enabled=true",
        f"lora.r={LORA.r}",
        f"lora.alpha={LORA.alpha}",
        "lora.target_modules=[q_proj,v_proj]",
    ]
    run = tmp_path / "run"
    more = dict(expert_parallel_size=2, **{"model.activation_checkpointing": "true"})
    check(launch(4, *overrides(cfg, converted["mixtral"], str(run), 2, **more), *targets, *NF4))
    plain = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, quantize="none"))
    dense = _round_tripped(hf_models["mixtral"], tmp_path / "nf4_dense")
    assert_matches_peft(run, plain, dense, tokenizer_dir, dp=2)
    attention_only = _round_tripped(hf_models["mixtral"], tmp_path / "nf4_attention", experts=False)
    _, theirs, _ = train_baseline(attention_only, tokenizer_dir, plain, dp=2, steps=1)
    step1 = read_jsonl(run / "metrics.jsonl")[0]["loss"]
    print(f"QLoRA Mixtral, NF4 experts: step 1 loss {step1:.7f}; with the experts dense {theirs[0]:.7f}")
    assert abs(step1 - theirs[0]) > 1e-4 * theirs[0]  # (the experts' NF4 moves it: the comparison above can tell)
    refused = launch(
        4, *overrides(cfg, converted["mixtral"], str(tmp_path / "no"), 2, expert_parallel_size=2), *targets, *NF4
    )
    assert refused.returncode != 0 and "needs model.activation_checkpointing=true" in refused.stderr


def assert_serves_on_a_4bit_base(run, cfg, hf_dir: str, adapters: dict, out) -> None:
    """`convert2ckpt.py --to-peft` of a QLoRA run, loaded by PEFT on transformers' 4-bit model of the base: the
    logits of that base with the run's adapters put in directly."""
    import sys

    from peft import PeftModel

    from tests.baseline import hf_model, quantized
    from tests.conftest import run_cmd

    check(run_cmd([sys.executable, "convert2ckpt.py", "--to-peft", "--input", str(run), "--output", str(out / "peft")]))
    model = PeftModel.from_pretrained(hf_model(hf_dir, dtype=torch.float32, **quantized(cfg)), str(out / "peft"))
    want = hf_model(hf_dir, dtype=torch.float32, **quantized(cfg))
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=LORA.r, lora_alpha=LORA.alpha, target_modules=LORA.target_modules), want)
    missing = want.load_state_dict({k.removeprefix("base_model.model."): v for k, v in adapters.items()}, False)
    assert not missing.unexpected_keys
    ids = torch.randint(3, 60, (2, 12))
    model.train(), want.train()  # (bitsandbytes' training path: its eval path repacks the weights on this CPU)
    torch.testing.assert_close(model(ids).logits, want(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,double", [("llama3", False), ("llama3", True), ("mixtral", False)])
def test_planner_counts_the_nf4_base(variant, double, hf_models):
    """The planner's weight bytes of a QLoRA model (fp32, one stage) equal what the model holds once quantized and
    adapted: its parameters and the NF4 weights' buffers, and with experts the one layer's experts a forward
    dequantizes."""
    from transformers import AutoConfig

    from models.lora import add_lora
    from tests.baseline import hf_model
    from tools.memory_model import estimate

    cfg = parity_cfg("unused")
    cfg.num_stages, cfg.deepspeed.precision = 1, "fp32"
    cfg.lora = dataclasses.replace(LORA, quantize="nf4", quantize_double=double)
    model = hf_model(hf_models[variant], dtype=torch.float32)
    quantize_stage(model, double)
    add_lora(model, LORA.r, LORA.alpha, 0.0, LORA.target_modules, seed=0)
    nf4 = sum(held_bytes(m) for m in model.modules() if isinstance(m, NF4Weight))
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + nf4
    dense_experts = [_dense_numel(m) for m in model.modules() if hasattr(m, "held_weights")]
    transient = max(dense_experts, default=0) * 4
    (planned,) = estimate(cfg, AutoConfig.from_pretrained(hf_models[variant]), 1)
    dense = sum(p.numel() * 4 for p in hf_model(hf_models[variant], dtype=torch.float32).parameters())
    print(f"NF4 base ({variant}, double={double}): planner {planned.weights:,.0f} bytes, held {held:,} + {transient:,}")
    print(f"  (dense fp32: {dense:,})")
    assert planned.weights == held + transient


def _dense_numel(experts: nn.Module) -> int:
    """Elements of an NF4 experts module's weights, dense."""
    return sum(math.prod(getattr(experts, f"{n}_held").shape) for n in experts.held_weights)


def test_the_reference_cache_knows_the_nf4_base(tmp_path):
    """DPO's cached reference log-probs are keyed on the NF4 base the reference pass ran on: a QLoRA run and a LoRA
    run over the same pairs never share them; a separate `dpo.reference_model` (not quantized) keys as it is."""
    from training.reference_logps import cache_file

    cfg = parity_cfg("unused")
    cfg.model_name_or_path, cfg.output_dir = str(tmp_path / "base"), str(tmp_path / "run")
    cfg.lora = dataclasses.replace(LORA, quantize="none")
    plain = cache_file(cfg, "pairs", {"ref": 1})
    cfg.lora = dataclasses.replace(LORA, quantize="nf4")
    nf4 = cache_file(cfg, "pairs", {"ref": 1})
    cfg.lora = dataclasses.replace(LORA, quantize="nf4", quantize_double=True)
    assert len({plain, nf4, cache_file(cfg, "pairs", {"ref": 1})}) == 3
    cfg.dpo.reference_model = str(tmp_path / "other")
    cfg.lora = dataclasses.replace(LORA, quantize="none")
    assert cache_file(cfg, "pairs", {"ref": 1}) == cache_file(
        dataclasses.replace(cfg, lora=dataclasses.replace(LORA, quantize="nf4")), "pairs", {"ref": 1}
    )
