"""Quantized hub checkpoints convert to plain weights: DeepSeek-V3's FP8 blocks, Mistral Small 4's FP8 tensors and
gpt-oss's MXFP4 experts dequantized as transformers does."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint.convert import convert_hf_to_pipeline
from checkpoint.dequantize import dequantize
from checkpoint.names import layer_file_name
from checkpoint.pipeline_reader import load_hf_state_dict
from tests.conftest import hf_state
from tools.quantized_hubs import BLOCK, int4_config, quantize_fp8, quantize_int4, quantize_mxfp4


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


def test_mxfp4_experts_are_dequantized_as_transformers_loads_them(hf_models, tmp_path):
    """gpt-oss's official checkpoints keep the experts in MXFP4 (`*_blocks`, `*_scales`). A copy of the gpt-oss test
    model quantized so converts to the weights transformers itself loads from it (`from_pretrained`, which
    dequantizes MXFP4 without its GPU kernels), bit for bit in bf16; every other tensor is the original's in bf16."""
    from transformers import AutoModelForCausalLM

    src = tmp_path / "mxfp4"
    quantized = quantize_mxfp4(hf_models["gpt_oss"], src)
    config = json.loads((src / "config.json").read_text())
    out = str(tmp_path / "ckpt")
    convert_hf_to_pipeline(str(src), out, log=lambda *_: None)
    ours = load_hf_state_dict(out)
    theirs = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).state_dict()
    assert len(quantized) == 2 * config["num_hidden_layers"] and set(ours) == set(theirs)
    original = hf_state(hf_models["gpt_oss"])
    for key, value in ours.items():
        assert value.dtype == torch.bfloat16 and torch.equal(value, theirs[key]), key
        if key in quantized:  # the fixture's quantization, 4 bits a value: near the original weights as a whole
            assert float((value.float() - original[key]).norm() / original[key].norm()) < 0.15, key
        else:
            assert torch.equal(value, original[key].to(torch.bfloat16)), key
    assert "quantization_config" not in json.loads(open(os.path.join(out, "config.json")).read())


def test_a_run_from_a_quantized_hub_directory_has_a_plain_model_config(tmp_path):
    """Training straight from an FP8 hub directory (converted at load, dequantized) builds, saves and exports a plain
    model: its config keeps no `quantization_config`."""
    from schema.compose import compose_config
    from tools.tiny_models import tiny_config
    from training.assembly import load_model_config

    config = tiny_config("deepseek_v3")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [16, 16]}
    config.save_pretrained(tmp_path / "fp8")
    cfg = compose_config([f"model_name_or_path={tmp_path}/fp8", f"train_file={tmp_path}/t.jsonl", "seq_length=16"])
    loaded = load_model_config(cfg)
    loaded.save_pretrained(tmp_path / "run")
    assert "quantization_config" not in json.loads((tmp_path / "run" / "config.json").read_text())


def test_kimi_k2_reads_as_deepseek_v3_and_other_compressed_tensors_are_refused(tmp_path, hf_models, converted):
    """Kimi K2's config.json says `kimi_k2` for DeepSeek-V3's architecture: it converts to the same layer files,
    verifies against its directory (transformers' DeepseekV3ForCausalLM, the class it names) and exports with its own
    model_type. Kimi K2.5's `quantization_config` sits at the container's top level: the text model's config carries
    it. A compressed-tensors scheme other than symmetric pack-quantized INT4 is refused in one line."""
    from models.config import text_config_json
    from tests.conftest import convert_in_process, one_error_line

    kimi = tmp_path / "kimi"
    shutil.copytree(hf_models["deepseek_v3"], kimi)
    config = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2"}))
    assert convert_in_process(["--input", str(kimi), "--output", str(tmp_path / "ckpt")]).returncode == 0
    ours, theirs = load_hf_state_dict(str(tmp_path / "ckpt")), load_hf_state_dict(converted["deepseek_v3"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    verified = convert_in_process(["--verify", str(tmp_path / "ckpt"), "--against", str(kimi)])
    assert verified.returncode == 0 and verified.stdout.strip().endswith(": 0"), verified.stdout + verified.stderr
    assert (
        convert_in_process(["--to-hf", "--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out")]).returncode
        == 0
    )
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_k2"

    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized"} | int4_config(symmetric=False)
    container = {
        "model_type": "kimi_k25",
        "text_config": config | {"model_type": "kimi_k2"},
        "quantization_config": int4,
    }
    assert text_config_json(container)["quantization_config"] == int4
    (kimi / "config.json").write_text(json.dumps(config | {"model_type": "kimi_k2", "quantization_config": int4}))
    refused = convert_in_process(["--input", str(kimi), "--output", str(tmp_path / "int4")])
    line = one_error_line(refused, "quantization_config compressed-tensors (format 'pack-quantized'")
    assert "'symmetric': False" in line and "convert a bf16 copy" in line and not (tmp_path / "int4").exists()


@pytest.mark.parametrize("strategy", ["group", "channel"])
def test_int4_experts_are_dequantized_as_transformers_loads_them(hf_models, tmp_path, strategy):
    """Kimi K2 Thinking's and K2.5's routed experts are INT4 (compressed-tensors, pack-quantized, symmetric, groups of
    32; here also one scale a row, the `channel` strategy). A copy of the DeepSeek-V3 test model whose experts
    compressed-tensors' own compressor packed so converts to the weights transformers loads from it
    (`from_pretrained`, dequantized; its fused experts cut back per expert), bit for bit in bf16; every other tensor
    is the original's in bf16, the config a plain model's. A packed weight whose scales do not fit it is refused in
    one line naming the weight."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from tests.conftest import convert_in_process, one_error_line

    src = tmp_path / "int4"
    quantized = quantize_int4(hf_models["deepseek_v3"], src, strategy)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    config = json.loads((src / "config.json").read_text())
    out = str(tmp_path / "ckpt")
    convert_hf_to_pipeline(str(src), out, log=lambda *_: None)
    ours = load_hf_state_dict(out)
    theirs = AutoModelForCausalLM.from_pretrained(
        str(src), quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16
    ).state_dict()
    original = hf_state(hf_models["deepseek_v3"])
    experts = config["n_routed_experts"]
    assert len(quantized) == 3 * experts * (config["num_hidden_layers"] - config["first_k_dense_replace"])
    for key, value in ours.items():
        if key in quantized:
            layer, expert, name = key.removesuffix(".weight").rsplit(".", 2)
            gate_up, down = (
                theirs[f"{layer.removesuffix('.experts')}.experts.gate_up_proj"],
                theirs[f"{layer}.down_proj"],
            )
            half = gate_up.shape[1] // 2
            want = {"gate_proj": gate_up[int(expert), :half], "up_proj": gate_up[int(expert), half:]}.get(name)
            want = down[int(expert)] if name == "down_proj" else want
            assert value.dtype == torch.bfloat16 and torch.equal(value, want), key
            assert float((value.float() - original[key]).norm() / original[key].norm()) < 0.15, key
        else:
            want = value.dtype if key.endswith("e_score_correction_bias") else torch.bfloat16
            assert value.dtype == want and torch.equal(value, original[key].to(want)), key
    assert "quantization_config" not in json.loads(open(os.path.join(out, "config.json")).read())

    bad = quantized[0].removesuffix("weight") + "weight_scale"
    shard = src / index["weight_map"][bad]
    state = load_file(shard)
    save_file(state | {bad: state[bad][:1].contiguous()}, shard, metadata={"format": "pt"})  # one row's scales
    refused = convert_in_process(["--input", str(src), "--output", str(tmp_path / "bad")])
    assert "does not fit" in one_error_line(refused, quantized[0]) and not (tmp_path / "bad").exists()


def test_kimi_k25_container_with_int4_experts(tmp_path):
    """Kimi K2.5 as the hub keeps it: a Kimi_K25ForConditionalGeneration directory whose text model's routed experts
    are INT4 (compressed-tensors, groups of 32), its `quantization_config` at the container's top level. Each expert
    converts to what compressed-tensors' decompressor computes from it (bf16, bit for bit), the rest to the original
    in bf16; the export is the container in bf16 without a `quantization_config`, its vision tower and projector
    byte for byte, loaded by its own class (a container's export drops the `quantization_config` its weights no longer
    have)."""
    import transformers
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as Packed
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    from checkpoint.names import CONTAINER_CONFIG
    from tests.conftest import convert_in_process
    from tests.multimodal import kimi_k25_as_on_the_hub, multimodal

    torch.manual_seed(0)
    mm, ckpt, export = tmp_path / "mm", tmp_path / "ckpt", tmp_path / "export"
    multimodal("kimi_k25")[0].save_pretrained(mm)
    kimi_k25_as_on_the_hub(mm)
    original = hf_state(str(mm))
    quant = int4_config()
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**quant["config_groups"]["group_0"]["weights"])
    )
    state, want = dict(original), {}
    for key in [k for k in original if ".mlp.experts." in k]:
        w = state.pop(key).to(torch.bfloat16)
        scale = (w.float().unflatten(1, (-1, 32)).abs().amax(-1) / 7.5).to(torch.bfloat16)
        packed = Packed.compress({"weight": w, "weight_scale": scale}, scheme)
        want[key] = Packed.decompress(dict(packed), scheme)["weight"].to(torch.bfloat16)
        state |= {key.removesuffix("weight") + name: t for name, t in packed.items()}
    save_file(state, mm / "model.safetensors", metadata={"format": "pt"})
    quant["ignore"] += ["re:.*vision_tower.*", "re:.*mm_projector.*"]
    (mm / "config.json").write_text(
        json.dumps(json.loads((mm / "config.json").read_text()) | {"quantization_config": quant})
    )
    assert convert_in_process(["--input", str(mm), "--output", str(ckpt)]).returncode == 0
    ours = load_hf_state_dict(str(ckpt))
    assert len(want) == 36 and {f"language_model.{k}" for k in ours} >= set(want)
    for key, value in ours.items():
        expected = want.get("language_model." + key, original["language_model." + key])
        dtype = value.dtype if key.endswith("e_score_correction_bias") else torch.bfloat16
        assert value.dtype == dtype and torch.equal(value, expected.to(dtype)), key
    assert convert_in_process(["--to-hf", "--input", str(ckpt), "--output", str(export)]).returncode == 0
    exported, conf = hf_state(str(export)), json.loads((export / "config.json").read_text())
    towers = [k for k in original if not k.startswith("language_model.")]
    assert towers and all(torch.equal(exported[k].view(torch.uint8), original[k].view(torch.uint8)) for k in towers)
    assert set(exported) == set(original) and "quantization_config" not in conf and conf["model_type"] == "kimi_k25"
    assert conf["dtype"] == "bfloat16" and conf["text_config"]["model_type"] == "kimi_k2"
    assert not (export / CONTAINER_CONFIG).exists()
    _, info = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(str(export), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def quantize_per_tensor(mm_dir: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A Mistral3ForConditionalGeneration directory quantized in place as Mistral's FP8 checkpoints are (transformers'
    convert_mistral4_weight_to_hf.py): the text model's linear weights FP8 with one scale per tensor
    (`weight_scale_inv`, a scalar: the largest magnitude / 448) and a static `activation_scale`, its fused experts
    with one scale per expert ([E, 1, 1]) and one activation scale per expert; the router, the head and the other
    towers as they were. Returns {hub key: (fp8 weight, scale)}."""
    path = os.path.join(mm_dir, "model.safetensors")
    state, quantized = load_file(path), {}
    for key in [k for k in state if k.startswith("language_model.model.layers.")]:
        w = state[key].float()
        linear, experts = key.endswith("_proj.weight"), key.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if not (linear or experts):
            continue
        amax = w.abs().amax() if linear else w.abs().amax(dim=(1, 2), keepdim=True)
        scale = (amax / 448.0).clamp_min(1e-12)
        state[key] = (w / scale).to(torch.float8_e4m3fn)
        state[key + "_scale_inv"] = scale
        base = key.removesuffix("weight") if linear else key + "_"
        state[base + "activation_scale"] = torch.rand(()) if linear else torch.rand(w.shape[0])
        quantized[key] = (state[key], scale)
    save_file(state, path, metadata={"format": "pt"})
    config = json.loads(open(os.path.join(mm_dir, "config.json")).read())
    config["quantization_config"] = {
        "activation_scheme": "static",
        "modules_to_not_convert": ["model.vision_tower", "model.multi_modal_projector", "lm_head"],
        "quant_method": "fp8",
        "weight_block_size": None,
    }
    with open(os.path.join(mm_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return quantized


def test_fp8_per_tensor_mistral_small_4_is_dequantized_as_transformers_does(tmp_path):
    """Mistral Small 4's hub checkpoint: a Mistral3ForConditionalGeneration whose `mistral4` text model is FP8 with
    one scale per tensor (and per expert of the fused experts) and static activation scales. Every FP8 weight lands
    in the checkpoint as transformers' `Fp8Dequantize` computes it (bf16, bit for bit); the activation scales are
    dropped, the rest cast to bf16; the export is the multimodal checkpoint in bf16 without a `quantization_config`,
    its vision tower and projector byte for byte, loaded by Mistral3ForConditionalGeneration."""
    import transformers
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from tests.conftest import convert_in_process
    from tests.multimodal import multimodal

    torch.manual_seed(0)
    model = multimodal("mistral3-mistral4")[0]
    model.save_pretrained(tmp_path / "mm")
    original = hf_state(str(tmp_path / "mm"))
    quantized = quantize_per_tensor(str(tmp_path / "mm"))
    assert any(v.dim() == 3 for v, _ in quantized.values()) and len(quantized) > 10
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    assert convert_in_process(["--input", str(tmp_path / "mm"), "--output", str(ckpt)]).returncode == 0
    ours = load_hf_state_dict(str(ckpt))
    for key, value in ours.items():
        hub = "language_model." + key
        if hub in quantized:
            want = Fp8Dequantize(None)._dequantize_one(*quantized[hub], output_dtype=torch.bfloat16)
            torch.testing.assert_close(value.float(), original[hub], rtol=0.07, atol=1e-3)  # near the original
        else:
            want = original[hub].to(torch.bfloat16)
        assert value.dtype == torch.bfloat16 and torch.equal(value, want), key
    assert "quantization_config" not in json.loads((ckpt / "config.json").read_text())
    assert convert_in_process(["--to-hf", "--input", str(ckpt), "--output", str(export)]).returncode == 0
    exported = hf_state(str(export))
    towers = {k for k in original if not k.startswith("language_model.")}
    assert set(exported) == set(original) and towers
    assert all(torch.equal(exported[k].view(torch.uint8), original[k].view(torch.uint8)) for k in towers)
    conf = json.loads((export / "config.json").read_text())
    assert conf["model_type"] == "mistral3" and "quantization_config" not in conf and conf["dtype"] == "bfloat16"
    transformers.Mistral3ForConditionalGeneration.from_pretrained(str(export))
    # transformers' own per-tensor FP8 experts keep a scale for each half of gate_up ([E, 2, 1]): the same products
    weight, scale = quantized["language_model.model.layers.1.mlp.experts.gate_up_proj"]
    halves = torch.cat([scale, scale * 0.5], dim=1)
    want = Fp8Dequantize(None)._dequantize_one(weight, halves, output_dtype=torch.bfloat16)
    assert torch.equal(dequantize(weight, halves, None, torch.bfloat16), want)


def qwen3_5_moe_fp8(out: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A tiny Qwen3.5-MoE saved by transformers' `save_pretrained` (its experts one key per expert), then FP8 blocks
    as `quantize_fp8` writes them, as Qwen's FP8 releases store them."""
    from transformers import AutoModelForCausalLM

    from tools.tiny_models import tiny_config

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("qwen3_5_moe_text", num_key_value_heads=2)).save_pretrained(
        out + ".src", max_shard_size="200KB"
    )
    return quantize_fp8(out + ".src", out)


def test_fp8_experts_stored_one_key_per_expert_are_dequantized_then_fused(tmp_path):
    """Qwen3.5-MoE's FP8 checkpoints keep one key per expert, each with its block scales; our layer files keep the
    hub's fused experts: each piece is dequantized as transformers' `Fp8Dequantize` computes it, then put in its
    place in the fused tensor (bit for bit), and every other FP8 weight likewise."""
    from transformers import AutoConfig
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    quantized = qwen3_5_moe_fp8(str(tmp_path / "fp8"))
    config = AutoConfig.from_pretrained(tmp_path / "fp8")
    assert any(".experts.3.up_proj." in k for k in quantized)
    convert_hf_to_pipeline(str(tmp_path / "fp8"), str(tmp_path / "ckpt"), log=lambda *_: None)
    ours = load_hf_state_dict(str(tmp_path / "ckpt"))

    def plain(key):
        return Fp8Dequantize(None)._dequantize_one(*quantized[key], output_dtype=torch.bfloat16)

    experts = 0
    for key, value in ours.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            base, experts = key.removesuffix("gate_up_proj"), experts + 1
            want = torch.stack(
                [
                    torch.cat([plain(f"{base}{e}.gate_proj.weight"), plain(f"{base}{e}.up_proj.weight")])
                    for e in range(4)
                ]
            )
        elif key.endswith("mlp.experts.down_proj"):
            want = torch.stack([plain(f"{key.removesuffix('down_proj')}{e}.down_proj.weight") for e in range(4)])
        elif key in quantized:
            want = plain(key)
        else:
            continue
        assert value.dtype == torch.bfloat16 and torch.equal(value, want), key
    assert experts == config.num_hidden_layers


def test_int4_schemes_not_built_are_refused_in_one_line():
    """INT4 with a quantized KV cache, permuted columns (`actorder: group`), or on a family whose experts are fused
    on the hub (Qwen3.5-MoE: its per-expert saves would need assembling from packed parts) is refused, naming why."""
    from checkpoint.dequantize import is_quantized
    from checkpoint.errors import CheckpointError
    from tools.tiny_models import tiny_config

    cases = [
        ("deepseek_v3", int4_config() | {"kv_cache_scheme": {"num_bits": 8}}, "'kv_cache_scheme': True"),
        ("deepseek_v3", int4_config(actorder="group"), "'actorder': 'group'"),
        ("qwen3_5_moe_text", int4_config(), "qwen3_5_moe_text, whose experts are fused on the hub"),
    ]
    for model_type, quant, fragment in cases:
        config = tiny_config(model_type)
        config.quantization_config = quant
        with pytest.raises(CheckpointError) as refused:
            is_quantized(config)
        assert fragment in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
