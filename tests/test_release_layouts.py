"""DeepSeek-V4 as DeepSeek publishes it: its own key names (`layers.0.attn.wq_a.weight`, `embed.weight`,
`hc_head_fn`, `mtp.*`), FP8 blocks with power-of-two scales under `<module>.scale` and FP4 experts. Conversion reads
it as transformers' `from_pretrained` does (its renames, its FP8 loader's `.scale`, its `Fp8Dequantize`). And a
checkpoint as transformers' save writes it where that differs from the hub's (Kimi Linear's dense MLP)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from checkpoint.convert import convert_hf_to_pipeline
from checkpoint.pipeline_reader import load_hf_state_dict
from checkpoint.reshard import reshard_checkpoint
from models.families import FAMILIES
from models.hub_names import memory_key, release_key
from tests.conftest import hf_state, run_cmd
from tools.quantized_hubs import FP4

FP8_BLOCK = [128, 128]  # DeepSeek-V4's: one block covers each of the tiny model's attention weights


def as_released(hf_dir: str, out: str, quantize: bool = False) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A copy of a saved DeepSeek-V4 under DeepSeek's release names in one shard, with a multi-token-prediction
    tensor (`mtp.0.*`); with `quantize` its attention projections FP8 (e4m3) in 128 x 128 blocks and its routed
    experts FP4 (two e2m1 values a byte, a scale per row and 32 columns), the scales powers of two (ue8m0) under
    `.scale`, as V4-Flash ships them. Returns {weight's release key: (quantized weight, scales)}."""
    shutil.copytree(hf_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = AutoConfig.from_pretrained(hf_dir)
    state = {release_key(config, k): v for k, v in hf_state(hf_dir).items()}
    state["mtp.0.emb.weight"] = torch.ones(4, 8)  # (transformers skips `mtp.*`: carried)
    quantized = {}
    for key in [k for k in state if quantize and k.endswith(".weight") and state[k].dim() == 2]:
        if ".attn.w" in key:  # wq_a, wq_b, wkv, wo_a, wo_b (the compressors' and indexers' stay bf16, as released)
            quantized[key] = _fp8(state[key])
        elif ".ffn.experts." in key:
            quantized[key] = _fp4(state[key])
    for key, (weight, scale) in quantized.items():
        state[key], state[key.removesuffix(".weight") + ".scale"] = weight, scale
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if quantize:
        with open(os.path.join(out, "config.json")) as f:
            raw = json.load(f)
        raw["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "expert_dtype": "fp4",
            "weight_block_size": FP8_BLOCK,
        }
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(raw, f, indent=2)
    return quantized


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax() / 448.0))).reshape(1, 1)  # one block, ue8m0
    return (w / scale).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = w.float().reshape(w.shape[0], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-30) / 6.0))
    index = (blocks / torch.exp2(exponent)[..., None])[..., None].sub(FP4).abs().argmin(-1).reshape(w.shape[0], -1)
    packed = (index[:, 0::2] | (index[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)
    return packed, torch.exp2(exponent).to(torch.float8_e8m0fnu)


def test_the_release_layout_converts_as_transformers_reads_it(hf_models, converted, tmp_path):
    """DeepSeek-V4 under DeepSeek's names converts to the same layer files as under transformers' (bit for bit), its
    `mtp.*` carried; `--verify --against` it gives transformers' logits exactly; resharded to TP=2 and exported, it
    is transformers' layout (as its save_pretrained writes it) with the multi-token-prediction tensor as released."""
    src, out, hf = str(tmp_path / "release"), str(tmp_path / "ckpt"), str(tmp_path / "hf")
    as_released(hf_models["deepseek_v4"], src)
    convert_hf_to_pipeline(src, out, log=lambda *_: None)
    ours, saved = load_hf_state_dict(out), load_hf_state_dict(converted["deepseek_v4"])
    assert set(ours) == set(saved) and all(torch.equal(ours[k], saved[k]) for k in saved)
    assert set(load_file(os.path.join(out, "hub_extra.safetensors"))) == {"mtp.0.emb.weight"}
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--verify", out, "--against", src])
    assert proc.returncode == 0 and "max |logit difference| against" in proc.stdout and proc.stdout.endswith(": 0\n")
    reshard_checkpoint(out, str(tmp_path / "tp2"), 2, log=lambda *_: None)
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--to-hf", "--input", str(tmp_path / "tp2"), "--output", hf])
    assert proc.returncode == 0, proc.stderr
    exported, original = hf_state(hf), hf_state(hf_models["deepseek_v4"])
    assert set(exported) == set(original) | {"mtp.0.emb.weight"}
    assert all(torch.equal(exported[k], v) for k, v in original.items())


def test_fp8_attention_and_fp4_experts_are_dequantized_as_transformers_does(hf_models, tmp_path):
    """V4-Flash's quantized weights (its attention FP8 with ue8m0 scales under `.scale`, its routed experts FP4, every
    other tensor plain) land in the layer files as transformers' `Fp8Dequantize` computes them (bf16), bit for bit;
    the rest cast to bf16 (what transformers keeps fp32 kept so); an FP4 weight without its scale is refused in one
    line."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src = str(tmp_path / "release")
    quantized = as_released(hf_models["deepseek_v4"], src, quantize=True)
    out = str(tmp_path / "ckpt")
    convert_hf_to_pipeline(src, out, log=lambda *_: None)
    ours, original = load_hf_state_dict(out), hf_state(hf_models["deepseek_v4"])
    config = AutoConfig.from_pretrained(src)
    saved = {release_key(config, k): k for k in original}
    assert sum(".experts." in k for k in quantized) == 4 * 3 * 6 and sum(".attn.w" in k for k in quantized) == 5 * 6
    for key, (weight, scale) in quantized.items():
        want = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.bfloat16)
        assert torch.equal(ours[saved[key]], want), key
        # The quantization is the fixture's: near the original weights (an FP4 step: up to a third of a block's largest)
        assert (want.float() - original[saved[key]]).abs().max() <= original[saved[key]].abs().max() / 3, key
    for key, value in ours.items():
        if release_key(config, key) not in quantized:
            # what transformers keeps fp32 in a bf16 model (its norms, hyper-connections, sinks, score biases)
            fp32 = FAMILIES["deepseek_v4"].keeps_fp32(memory_key(config, key), torch.bfloat16)
            fp32 = fp32 or not value.is_floating_point()
            assert torch.equal(value, original[key] if fp32 else original[key].to(torch.bfloat16)), key
    state = load_file(os.path.join(src, "model.safetensors"))
    del state["layers.0.ffn.experts.0.w1.scale"]
    save_file(state, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--input", src, "--output", str(tmp_path / "bad")])
    assert proc.returncode == 2 and not os.path.exists(tmp_path / "bad")
    assert proc.stderr.strip().endswith(
        "model.layers.0.ffn.experts.0.w1.weight is FP4 without its scale "
        "(model.layers.0.ffn.experts.0.w1.weight_scale_inv)"
    ), proc.stderr


def test_a_checkpoint_saved_by_transformers_converts_under_the_hubs_names(hf_models, converted, tmp_path):
    """Kimi Linear as transformers' `save_pretrained` writes it (its dense first layer's MLP under the sparse block's
    hub name, `block_sparse_moe`; the release keeps `mlp`): conversion reads it under the hub's names, into the same
    layer files as the hub's layout, bit for bit; `--verify --against` it gives transformers' logits exactly; the
    export is the hub's layout."""
    from transformers import AutoModelForCausalLM

    src, out, hf = tmp_path / "saved", str(tmp_path / "ckpt"), str(tmp_path / "hf")
    AutoModelForCausalLM.from_pretrained(hf_models["kimi_linear"]).save_pretrained(src)
    assert any(".layers.0.block_sparse_moe." in k for k in hf_state(str(src)))  # (transformers' name for it)
    convert_hf_to_pipeline(str(src), out, log=lambda *_: None)
    ours, hub = load_hf_state_dict(out), load_hf_state_dict(converted["kimi_linear"])
    assert set(ours) == set(hub) and all(torch.equal(ours[k], hub[k]) for k in hub)
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--verify", out, "--against", str(src)])
    assert proc.returncode == 0 and proc.stdout.endswith(": 0\n"), proc.stdout
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--to-hf", "--input", out, "--output", hf])
    assert proc.returncode == 0, proc.stderr
    exported, original = hf_state(hf), hf_state(hf_models["kimi_linear"])
    assert set(exported) == set(original) and all(torch.equal(exported[k], v) for k, v in original.items())
