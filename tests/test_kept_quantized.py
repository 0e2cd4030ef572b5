"""`lora.keep_quantized=true`: the hub's FP8 blocks (DeepSeek-V3) and MXFP4 experts (gpt-oss) held as they are on a
stage (checkpoint/kept_quantized.py) compute exactly as the base conversion dequantizes, in less memory."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpoint.convert import convert_hf_to_pipeline
from checkpoint.export import export_pipeline_to_hf
from checkpoint.kept_quantized import hold_hub_weights, keep_quantized_refusal
from models.frozen_weights import held_bytes
from models.hub_quantized import FP8Weight, INT4Weight, MXFP4Weight, fp8_bytes, int4_bytes, mxfp4_bytes
from models.sharding import COLUMN, EXPERT_ROW, GATE_UP, ROW, parts_rule
from tests.baseline import hf_model
from tests.test_quantized_sources import qwen3_5_moe_fp8
from tools.quantized_hubs import quantize_fp8, quantize_int4, quantize_mxfp4

QUANTIZE = {
    "deepseek_v3": lambda hf_models, out: quantize_fp8(hf_models["deepseek_v3"], out),
    "gpt_oss": lambda hf_models, out: quantize_mxfp4(hf_models["gpt_oss"], out),
    # Kimi K2 Thinking's layout is DeepSeek-V3's, its experts INT4
    "kimi_k2_int4": lambda hf_models, out: quantize_int4(hf_models["deepseek_v3"], out),
    "qwen3_5_moe": lambda _, out: qwen3_5_moe_fp8(out),  # (its experts one FP8 key each, under fused hub names)
    "llama3": lambda hf_models, out: quantize_fp8(hf_models["llama3"], out),  # (dense, FP8 blocks: split under TP)
}


EP2 = dict(expert_parallel_size=2, **{"model.activation_checkpointing": "true"})
TP2 = dict(tensor_parallel_size=2)


def dequantized_copy(src: str, out) -> str:
    """The quantized hub directory `src` converted (its weights dequantized to bf16, as a run converts it at load)
    and exported: the plain base a kept-quantized run must compute with."""
    convert_hf_to_pipeline(src, str(out / "ckpt"), log=lambda *_: None)
    export_pipeline_to_hf(str(out / "ckpt"), str(out / "plain"), log=lambda *_: None)
    return str(out / "plain")


def _decoder_bytes(model) -> int:
    return sum(held_bytes(layer) for layer in model.model.layers)


@pytest.mark.parametrize("variant", list(QUANTIZE))
def test_a_kept_quantized_base_computes_as_the_dequantized_one(variant, hf_models, tmp_path):
    """A model holding the hub's quantized tensors (every FP8 linear weight, DeepSeek's per-expert FP8 keys stacked
    into the fused experts, gpt-oss's MXFP4 experts, Kimi K2 Thinking's per-expert INT4 keys stacked) gives the
    dequantized base's logits and input gradients bit for bit in fp32, and holds its decoder layers in at most 0.6x of
    their bf16 bytes; Qwen3.5-MoE's experts stored one FP8 key per expert under its fused hub names likewise."""
    src = str(tmp_path / "hub")
    quantized = QUANTIZE[variant](hf_models, src)
    plain_dir = dequantized_copy(src, tmp_path)
    plain, kept = (hf_model(plain_dir, dtype=torch.float32).train() for _ in range(2))
    count = hold_hub_weights(kept, src, kept.config)
    held = [m for m in kept.modules() if isinstance(m, (FP8Weight, MXFP4Weight, INT4Weight))]
    assert count == len(held) > 0
    if variant in ("deepseek_v3", "kimi_k2_int4", "qwen3_5_moe"):  # each sparse layer: E x 3 keys held as 2 tensors
        sparse = sum(hasattr(m, "held_weights") for m in kept.modules())
        experts = getattr(kept.config, "n_routed_experts", None) or kept.config.num_experts
        assert len(held) == len(quantized) - (3 * experts - 2) * sparse > 0
    else:
        assert len(held) == len(quantized)
    ids = torch.randint(3, 60, (2, 12))
    outs = []
    for model in (plain, kept):
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeds).logits
        (grad,) = torch.autograd.grad(logits.square().sum(), [embeds])
        outs.append((logits, grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert all(n not in m.__dict__ for m in kept.modules() for n in getattr(m, "held_weights", []))
    plain.to(torch.bfloat16), kept.to(torch.bfloat16)  # (the held bytes stay what they are)
    ratio = _decoder_bytes(kept) / _decoder_bytes(plain)
    print(f"{variant}: decoder layers {_decoder_bytes(kept):,} bytes kept against {_decoder_bytes(plain):,} in bf16")
    if variant == "qwen3_5_moe":  # (the fixture quantizes `*_proj` weights only: its linear attention's stay bf16)
        assert ratio < 0.9, ratio
    else:
        assert ratio <= 0.6, ratio


@pytest.mark.parametrize("variant", list(QUANTIZE))
def test_planner_counts_the_kept_base(variant, hf_models, tmp_path):
    """The planner's weight bytes of a kept-quantized LoRA model (fp32, one stage, its hub directory read for how it
    is quantized) equal what
    the model holds once held and adapted: its parameters, the held weights' bytes and the one layer's experts a
    forward dequantizes."""
    from models.lora import add_lora
    from models.tensor_parallel import TensorParallel
    from schema.model import LoraSettings
    from tests.test_training import parity_cfg
    from tools.memory_model import estimate, hub_quantization, kept_layer_counts

    src = str(tmp_path / "hub")
    QUANTIZE[variant](hf_models, src)
    model = hf_model(dequantized_copy(src, tmp_path), dtype=torch.float32)
    cfg = parity_cfg("unused")
    cfg.num_stages, cfg.deepspeed.precision, cfg.model_name_or_path = 1, "fp32", src
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=["o_proj"], keep_quantized=True)
    hold_hub_weights(model, src, model.config)
    add_lora(model, 4, 8.0, 0.0, ["o_proj"], seed=0)
    kept = sum(held_bytes(m) for m in model.modules() if isinstance(m, (FP8Weight, MXFP4Weight, INT4Weight)))
    held = sum(p.numel() * p.element_size() for p in model.parameters()) + kept
    experts = [m for m in model.modules() if hasattr(m, "held_weights")]
    dense = [sum(getattr(m, f"{n}_held").dequantize().numel() for n in m.held_weights) for m in experts]
    transient = max(dense, default=0) * 4
    (planned,) = estimate(cfg, model.config, 1)  # (the run's config: the hub's says how it is quantized)
    print(f"kept base ({variant}): planner {planned.weights:,.0f} bytes, held {held:,} + {transient:,}")
    assert planned.weights == held + transient
    quant, present = hub_quantization(src, model.config)
    whole = kept_layer_counts(model.config, 1, quant, present)
    if variant != "qwen3_5_moe":  # these fixtures quantize what the releases do: a preset's count (no hub) agrees
        assert kept_layer_counts(model.config, 1, quant) == whole
    if variant == "llama3":  # a TP=2 rank holds half of every projection, whole blocks and their scales
        halves = kept_layer_counts(model.config, 1, quant, present, TensorParallel(2, 0))
        assert [tuple(2 * n for n in c) for c in halves] == whole and sum(c[1] for c in whole) > 0
    assert mxfp4_bytes(4096 * 4096) * 8 / (4096 * 4096) == 4.25
    assert int4_bytes(4096, 4096, 32) * 8 / (4096 * 4096) == 4.5  # (bf16 scales, groups of 32)
    assert fp8_bytes(4096, 4096, (128, 128)) == 4096 * 4096 + 4 * 32 * 32  # a byte a weight, an fp32 scale a block


@pytest.mark.parametrize("rule", [COLUMN, ROW, GATE_UP, EXPERT_ROW, parts_rule(2, 1, 1)])
def test_an_fp8_shard_holds_its_blocks_scales(rule):
    """Each tensor-parallel rank's shard of an FP8 weight and its scales dequantizes to its shard of the dequantized
    weight, bit for bit, by every split rule; a split that cuts a block is refused in one line."""
    from checkpoint.kept_quantized import _shard_fp8
    from models.hub_quantized import dequantize
    from models.sharding import shard

    torch.manual_seed(0)
    shape = (3, 128, 64) if rule in (GATE_UP, EXPERT_ROW) else (128, 64)
    weight = torch.randn(shape).to(torch.float8_e4m3fn)
    scale = torch.rand(*shape[:-2], 128 // 16, 64 // 16)
    whole = dequantize(weight, scale, (16, 16), torch.float32)
    for rank in range(2):
        w, s = _shard_fp8(weight, scale, (16, 16), rule, rank, 2)
        assert torch.equal(dequantize(w, s, (16, 16), torch.float32), shard(whole, rule, rank, 2))
    with pytest.raises(ValueError, match=r"^tensor parallel size 16 cuts its 16-wide FP8 blocks"):
        _shard_fp8(weight, scale, (16, 16), rule, 0, 16)


def test_fp4_experts_held_and_split_by_their_scale_grid():
    """DeepSeek-V4's FP4 experts (int8, two values a byte, a one-byte scale a row and 32 columns), stacked [E, R, C/2]:
    held, they dequantize to each expert's own dequantized matrix; each TP rank's shard by the experts' column rule
    to its shard of those, bit for bit."""
    from checkpoint.kept_quantized import _shard_fp8
    from models.hub_quantized import dequantize
    from models.sharding import shard

    torch.manual_seed(0)
    weight = torch.randint(-128, 127, (3, 8, 64), dtype=torch.int8)  # [E, rows, 128 values / 2]
    scale = torch.randint(120, 130, (3, 8, 128 // 32), dtype=torch.uint8)
    held = FP8Weight(weight, scale, (128, 128), torch.float32)
    whole = torch.stack([dequantize(w, s, None, torch.float32) for w, s in zip(weight, scale, strict=True)])
    assert held.shape == (3, 8, 128) and torch.equal(held.dequantize(), whole)
    for rank in range(2):
        w, s = _shard_fp8(weight, scale, (128, 128), EXPERT_ROW, rank, 2)
        assert torch.equal(FP8Weight(w, s, (128, 128), torch.float32).dequantize(), shard(whole, EXPERT_ROW, rank, 2))


def test_keep_quantized_refusals(hf_models, tmp_path):
    """Without LoRA, with NF4, from a plain or converted source, MXFP4 under TP: one line each."""
    from schema.checks import check_config
    from tests.test_lora import LORA
    from tests.test_training import parity_cfg

    cfg = parity_cfg("unused")
    cfg.model_name_or_path = "x"
    cfg.lora = dataclasses.replace(LORA, enabled=False, keep_quantized=True)
    with pytest.raises(ValueError, match=r"^lora.keep_quantized=true needs lora.enabled=true$"):
        check_config(cfg)
    cfg.lora = dataclasses.replace(LORA, keep_quantized=True, quantize="nf4")
    with pytest.raises(ValueError, match=r"^lora.keep_quantized=true with lora.quantize=nf4: "):
        check_config(cfg)
    src = str(tmp_path / "hub")
    quantize_fp8(hf_models["deepseek_v3"], src)
    assert keep_quantized_refusal(src, 1) is None and keep_quantized_refusal(src, 2) is None
    quantize_mxfp4(hf_models["gpt_oss"], str(tmp_path / "mxfp4"))
    assert "only FP8 weights are split across TP ranks, not MXFP4" in keep_quantized_refusal(str(tmp_path / "mxfp4"), 2)
    assert "is not quantized" in keep_quantized_refusal(hf_models["deepseek_v3"], 1)
    assert "needs model_name_or_path to be the quantized Hugging Face directory" in keep_quantized_refusal(
        str(tmp_path), 1
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant,targets,layout",
    [
        ("deepseek_v3", ["q_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "down_proj"], EP2),
        ("gpt_oss", ["q_proj", "k_proj", "v_proj", "o_proj"], EP2),
        ("llama3", ["q_proj", "k_proj", "v_proj", "o_proj"], TP2),
    ],
)
def test_lora_on_a_kept_quantized_base_matches_the_dequantized_base(
    variant, targets, layout, hf_models, tokenizer_dir, sft_data, tmp_path
):
    """From the quantized hub directory itself (converted at load), 4 AdamW steps with clipping, the base kept in FP8
    blocks (DeepSeek-V3 at PP=2 x DP=2 x EP=2, every block recomputed: attention, shared and routed experts, the
    dense MLP; Llama 3.1 at PP=2 x TP=2: each rank its shard of every projection and its blocks' scales) or MXFP4
    experts (gpt-oss at PP=2 x DP=2 x EP=2): losses, grad norms and adapters equal PEFT trained in one process on the
    dequantized base, by LoRA's bounds; each stage says what it holds."""
    from schema.model import LoraSettings
    from tests.conftest import check, launch, read_jsonl
    from tests.test_lora import assert_matches_peft
    from tests.test_training import overrides, parity_cfg

    cfg = parity_cfg(sft_data[0])
    cfg.lora = LoraSettings(enabled=True, r=4, alpha=8.0, target_modules=targets)
    src = str(tmp_path / "hub")
    (quantize_mxfp4 if variant == "gpt_oss" else quantize_fp8)(hf_models[variant], src)
    lora = ["lora.enabled=true", "lora.r=4", "lora.alpha=8.0", f"lora.target_modules=[{','.join(targets)}]"]
    run = tmp_path / "run"
    out = check(launch(4, *overrides(cfg, src, str(run), 2, **layout), *lora, "lora.keep_quantized=true"))
    held = [line for line in (out.stdout + out.stderr).splitlines() if "lora.keep_quantized:" in line]
    print(variant, *held, sep="\n")
    assert len(held) == 2 and all(" 0 weights held" not in line for line in held)  # (a line per stage)
    dp = 4 // (2 * layout.get("tensor_parallel_size", 1))
    assert_matches_peft(run, cfg, dequantized_copy(src, tmp_path), tokenizer_dir, dp=dp)
    assert len(read_jsonl(run / "metrics.jsonl")) == cfg.max_steps
