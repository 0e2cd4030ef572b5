"""Quantized copies of Hugging Face model directories, as the releases store them: DeepSeek-V3's FP8 blocks, gpt-oss's
MXFP4 experts, Kimi K2 Thinking's and K2.5's INT4 experts (compressed-tensors' own compressor). What the conversion
tests (tests/test_quantized_sources.py), the kept-quantized tests (tests/test_kept_quantized.py) and
benchmarks/kept_base_memory.py start from, beside the tiny models of tools/tiny_models.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = (16, 16)  # DeepSeek's are 128 x 128; at hidden 64, 16 x 16 tiles most weights and cuts kv_b_proj's 24 columns


def quantize_fp8(hf_dir: str, out: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A copy of `hf_dir` whose decoder layers' projection weights are FP8 (e4m3) in BLOCK blocks, each block's
    scale beside it (`weight_scale_inv`: the block's largest magnitude / 448), as DeepSeek ships them; config.json
    says so (`quantization_config`). Returns {weight key: (fp8 weight, scales)}."""
    shutil.copytree(hf_dir, out)
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    layers = config["num_hidden_layers"]
    quantized = {}
    for shard in sorted(n for n in os.listdir(out) if n.endswith(".safetensors")):
        state = load_file(os.path.join(out, shard))
        for key in [k for k, v in state.items() if k.endswith(("_proj.weight", "_mqa.weight")) and v.dim() == 2]:
            if int(key.split(".")[2]) >= layers:  # the multi-token-prediction layer is carried as it is
                continue
            w = state[key].float()
            rows, cols = -(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1])
            padded = torch.zeros(rows * BLOCK[0], cols * BLOCK[1])
            padded[: w.shape[0], : w.shape[1]] = w
            amax = padded.view(rows, BLOCK[0], cols, BLOCK[1]).abs().amax(dim=(1, 3))
            scale = (amax / 448.0).clamp_min(1e-12)
            grid = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[: w.shape[0], : w.shape[1]]
            state[key] = (w / grid).to(torch.float8_e4m3fn)
            state[key + "_scale_inv"] = scale
            quantized[key] = (state[key], scale)
        save_file(state, os.path.join(out, shard), metadata={"format": "pt"})
    index_path = os.path.join(out, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"] |= {k + "_scale_inv": index["weight_map"][k] for k in quantized}
    with open(index_path, "w") as f:
        json.dump(index, f)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return quantized


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert tensor [E, rows, cols] (x @ W) as gpt-oss's checkpoints store it: per [E, cols, rows / 32] block of
    32 values a power-of-two scale (exponent + 127, uint8) and 16 bytes of two e2m1 values each (low nibble first)."""
    w = weight.float().transpose(1, 2)  # [E, cols, rows]: what transformers' routine transposes back
    blocks = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    index = (scaled[..., None] - FP4).abs().argmin(-1)  # nearest e2m1 value (its sign bit included)
    packed = (index[..., 0::2] | (index[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def quantize_mxfp4(hf_dir: str, out) -> list[str]:
    """A copy of `hf_dir` (gpt-oss) with its experts in MXFP4 as gpt-oss ships them; returns the quantized keys."""
    src = Path(out)
    shutil.copytree(hf_dir, src)
    quantized = []
    for shard in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
        state = load_file(src / shard)
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            state[key + "_blocks"], state[key + "_scales"] = _to_mxfp4(state.pop(key))
            quantized.append(key)
        save_file(state, src / shard, metadata={"format": "pt"})
    index_path = src / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        for key in quantized:
            shard = index["weight_map"].pop(key)
            index["weight_map"] |= {key + "_blocks": shard, key + "_scales": shard}
        index_path.write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (src / "config.json").write_text(json.dumps(config))
    return quantized


ARGS = {"group": {"strategy": "group", "group_size": 32}, "channel": {"strategy": "channel", "group_size": None}}


def int4_config(**weights) -> dict:
    """Kimi K2 Thinking's and K2.5's `quantization_config` (their routed experts INT4 in groups of 32), `weights`
    changed."""
    args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32} | weights
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"],
    }


def quantize_int4(hf_dir: str, out, strategy: str = "group") -> list[str]:
    """A copy of `hf_dir` (DeepSeek-V3's layout, as Kimi K2 Thinking's) whose routed experts compressed-tensors'
    own compressor packed to INT4 (`ARGS[strategy]`); config.json says so. Returns the quantized keys."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    src = Path(out)
    shutil.copytree(hf_dir, src)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**int4_config(**ARGS[strategy])["config_groups"]["group_0"]["weights"]),
    )
    index = json.loads((src / "model.safetensors.index.json").read_text())
    config = json.loads((src / "config.json").read_text())
    layers, quantized = config["num_hidden_layers"], []
    for shard in sorted(n for n in os.listdir(src) if n.endswith(".safetensors")):
        state = load_file(src / shard)
        for key in [k for k in state if ".mlp.experts." in k and int(k.split(".")[2]) < layers]:  # MTP: as is
            w = state.pop(key).to(torch.bfloat16)
            scale = w.float().unflatten(1, (-1, ARGS[strategy]["group_size"] or w.shape[1])).abs().amax(-1) / 7.5
            scale = scale.to(torch.bfloat16)
            packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
            parts = {key.removesuffix("weight") + name: t for name, t in packed.items()}
            state |= parts
            index["weight_map"] |= dict.fromkeys(parts, index["weight_map"].pop(key))
            quantized.append(key)
        save_file(state, src / shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "config.json").write_text(json.dumps(config | {"quantization_config": int4_config(**ARGS[strategy])}))

    return quantized
