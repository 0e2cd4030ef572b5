"""Quantized hub checkpoints convert to plain weights: DeepSeek-V3's FP8 blocks dequantized as transformers does."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from checkpoint.convert import convert_hf_to_pipeline
from checkpoint.names import layer_file_name
from checkpoint.pipeline_reader import load_hf_state_dict
from tests.conftest import hf_state

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
        for key in [k for k, v in state.items() if k.endswith("_proj.weight") and v.dim() == 2]:
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


def test_fp8_blocks_are_dequantized_as_transformers_does(hf_models, tmp_path):
    """Every FP8 weight of a DeepSeek-V3 checkpoint lands in its layer file as transformers' `Fp8Dequantize`
    computes it (bf16), bit for bit where the blocks divide the weight; a weight whose columns the blocks do not
    divide takes each edge block's scale over what is left of it; everything else is cast to bf16 (the router's
    score bias stays fp32, as transformers keeps it); the converted config.json is a plain bf16 model's."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    src = str(tmp_path / "fp8")
    quantized = quantize_fp8(hf_models["deepseek_v3"], src)
    out = str(tmp_path / "ckpt")
    convert_hf_to_pipeline(src, out, log=lambda *_: None)
    ours = load_hf_state_dict(out)
    original = hf_state(hf_models["deepseek_v3"])
    ragged = 0
    for key, (weight, scale) in quantized.items():
        rows, cols = weight.shape
        if rows % BLOCK[0] == 0 and cols % BLOCK[1] == 0:
            want = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.bfloat16)
        else:  # block by block
            ragged += 1
            want = torch.empty(rows, cols, dtype=torch.bfloat16)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    r, c = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
                    want[r, c] = (weight[r, c].float() * scale[i, j]).to(torch.bfloat16)
        assert ours[key].dtype == torch.bfloat16 and torch.equal(ours[key], want), key
        # The quantization is the fixture's: the dequantized weights are near the original ones.
        torch.testing.assert_close(ours[key].float(), original[key], rtol=0.07, atol=1e-3)
    assert ragged and len(quantized) > 20
    for key, value in ours.items():
        if key not in quantized:
            want = value.dtype if key.endswith("e_score_correction_bias") else torch.bfloat16
            assert value.dtype == want and torch.equal(value, original[key].to(want)), key
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert not any(
        k.endswith("_scale_inv")
        for k in torch.load(os.path.join(out, "global_step0", layer_file_name(2)), weights_only=True)
    )
