"""convert2ckpt.py: every HF tensor lands once in the right file; 70B shapes; bounded memory; clear errors."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint.convert import convert_hf_to_pipeline
from checkpoint.names import CARRIED_FILE, layer_file_name
from checkpoint.pipeline_reader import load_hf_state_dict
from models.families import ALIASES
from models.hub_names import hub_key, memory_key
from models.key_table import is_carried, layer_keys
from models.pipe_layout import pipe_layers
from tests.conftest import CARRYING_VARIANTS, FAMILY_VARIANTS, hf_state, one_error_line, run_cmd
from tests.multimodal import kimi_k25_as_on_the_hub, multimodal, text_rows_compute_as
from tools.tiny_models import make_hf_model, tiny_config


@pytest.mark.parametrize("variant", ["mha", "gqa", "tied", *FAMILY_VARIANTS, "glm_moe_dsa", "deepseek_v4"])
def test_every_tensor_lands_once_in_its_file(variant, hf_models, converted):
    hf_dir, ckpt = hf_models[variant], converted[variant]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_dir)
    step_dir = os.path.join(ckpt, "global_step0")
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    expected_files = {layer_file_name(layer.index) for layer in layers if layer.has_file}
    assert set(os.listdir(step_dir)) == expected_files | {"mp_rank_00_model_states.pt", "manifest.json"}
    assert open(os.path.join(ckpt, "latest")).read() == "global_step0"
    reference = hf_state(hf_dir)
    landed: dict[str, int] = {}
    for layer in layers:
        if not layer.has_file:
            continue
        state = torch.load(os.path.join(step_dir, layer_file_name(layer.index)), weights_only=True)
        keys = layer_keys(layer, config)
        assert set(state) == set(keys), layer
        for ours, hf in keys.items():
            assert torch.equal(state[ours], reference[hf]) and state[ours].dtype == reference[hf].dtype, hf
            landed[hf] = landed.get(hf, 0) + 1
    tied = config.tie_word_embeddings
    carried = {k: v for k, v in reference.items() if is_carried(k, config)}  # a multi-token-prediction layer
    assert landed == {k: 1 for k in reference if not (tied and k == "lm_head.weight") and k not in carried}
    assert bool(carried) == (variant in CARRYING_VARIANTS)
    if carried:  # kept aside as the hub stored it, FP8 tensors and their scales too
        kept = load_file(os.path.join(ckpt, CARRIED_FILE))
        assert set(kept) == set(carried)
        for key, value in carried.items():
            assert kept[key].dtype == value.dtype and torch.equal(kept[key].view(torch.uint8), value.view(torch.uint8))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name


# preset: (a hub key of its last layer, its shape), total parameters (B), parameters per token (B; MoE presets)
PRESETS = {
    "llama2_70b": ("model.layers.79.self_attn.k_proj.weight", (1024, 8192), 68.98, None),  # GQA: 8 KV heads x 128
    "qwen2_5_7b": ("model.layers.27.self_attn.k_proj.bias", (512,), 7.62, None),  # 4 KV heads x 128, biased
    "qwen3_8b": ("model.layers.35.self_attn.q_norm.weight", (128,), 8.19, None),
    "qwen3_30b_a3b": ("model.layers.47.mlp.experts.127.down_proj.weight", (2048, 768), 30.53, 3.35),
    "mixtral_8x7b": ("model.layers.31.block_sparse_moe.experts.7.w3.weight", (14336, 4096), 46.7, 12.88),
    "llama4_scout": ("model.layers.47.feed_forward.experts.gate_up_proj", (16, 5120, 2 * 8192), 107.77, 17.17),
    "phi4": ("model.layers.39.self_attn.qkv_proj.weight", (5120 + 2 * 10 * 128, 5120), 14.66, None),  # q, k, v rows
    "deepseek_v3": ("model.layers.60.self_attn.kv_b_proj.weight", (128 * (128 + 128), 512), 671.03, 37.55),
    "deepseek_v32": ("model.layers.60.self_attn.indexer.wq_b.weight", (64 * 128, 1536), 671.88, 38.40),
    "kimi_k2": ("model.layers.60.mlp.experts.383.down_proj.weight", (7168, 2048), 1026.41, 32.86),
    "gpt_oss_120b": ("model.layers.35.mlp.experts.gate_up_proj_bias", (128, 2 * 2880), 116.83, 5.71),
    "gpt_oss_20b": ("model.layers.23.mlp.experts.gate_up_proj_bias", (32, 2 * 2880), 20.91, 4.19),
    "llama3_1_70b": ("model.layers.79.self_attn.k_proj.weight", (1024, 8192), 70.55, None),  # Llama-2 70B's + vocab
    "qwen3_32b": ("model.layers.63.self_attn.q_norm.weight", (128,), 32.76, None),
    "glm4_5_air": ("model.layers.45.self_attn.q_proj.bias", (96 * 128,), 106.85, 13.42),
    "glm4_7_flash": ("model.layers.46.self_attn.kv_b_proj.weight", (20 * (192 + 256), 512), 29.94, 3.9),  # MLA
    "minimax_m2": ("model.layers.61.block_sparse_moe.experts.255.w2.weight", (3072, 1536), 228.69, 11.03),
    "gemma3_27b": ("model.layers.61.self_attn.k_proj.weight", (16 * 128, 5376), 27.01, None),
    "gemma4_31b": ("model.layers.59.self_attn.k_proj.weight", (4 * 512, 5376), 30.7, None),  # a global layer's: 4 x 512
    "gemma4_e4b": ("model.embed_tokens_per_layer.weight", (262144, 42 * 256), 7.46, None),  # its PLE table: 2.82B
    "gemma4_26b_a4b": ("model.layers.29.experts.gate_up_proj", (128, 2 * 704, 2816), 25.23, 3.82),
    "glm5": ("model.layers.6.self_attn.indexer.wq_b.weight", (32 * 128, 2048), 743.38, 41.25),  # a "full" layer's
    "deepseek_v4_flash": ("model.layers.42.attn.wo_a.weight", (8 * 1024, 8 * 512), 284.33, 13.80),
    "olmo3_32b": ("model.layers.63.self_attn.k_norm.weight", (8 * 128,), 32.23, None),  # q/k norms: whole projections
    "qwen3_5_27b": ("model.layers.62.linear_attn.in_proj_qkv.weight", (2 * 16 * 128 + 48 * 128, 5120), 26.9, None),
    # Qwen3-Next's fused q, k (16 heads of 128 each), v and z (32 of 128 each)
    "qwen3_next_80b_a3b": ("model.layers.46.linear_attn.in_proj_qkvz.weight", (12288, 2048), 79.67, 3.87),
    "nemotron3_nano": ("backbone.layers.51.mixer.experts.127.down_proj.weight", (2688, 1856), 31.58, 3.58),
    "kimi_linear_48b_a3b": ("model.layers.26.self_attn.kv_b_proj.weight", (32 * (128 + 128), 512), 49.12, 3.48),
}


FAST = ("llama2_70b", "qwen2_5_7b", "qwen3_8b", "phi4", "llama4_scout", "qwen3_30b_a3b", "mixtral_8x7b")  # fast tier
SLOW_PRESETS = tuple(p for p in PRESETS if p not in FAST)  # 2026's: the slow tier (~2 s each, meta device)


@pytest.mark.parametrize(
    "preset_name", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PRESETS else p for p in PRESETS]
)
def test_layer_modules_match_hf_at_preset_shapes(preset_name):
    """Shape-only conversion of every shipped preset on the meta device: our layer modules' keys and shapes are exactly
    what the table maps from the hub's layout (transformers' own per-expert names for the experts it fuses in memory),
    and the planner counts the parameters transformers' model has, in all and per token (the model cards: Qwen2.5-7B
    7.61B, Qwen3-8B 8.19B, Qwen3-30B-A3B 30.5B, Mixtral 46.7B, Llama 4 Scout 109B with its vision tower, Phi-4 14B,
    OLMo 3 32B, Qwen3.5 27B with its vision tower, DeepSeek-V3 671B / 37B, Kimi K2 1T / 32B, gpt-oss-120b 117B,
    GLM-4.5-Air 106B / 12B, Qwen3-Next 80B / 3B, GLM-4.7-Flash 30B / 3B, MiniMax-M2 230B / 10B, Nemotron 3 Nano
    31.6B / 3.2B, Kimi Linear 48B / 3B; per token here with the embedding and head)."""
    from transformers import AutoModelForCausalLM

    from models.config import check_preset, config_from_preset
    from models.layers import build_layer
    from models.moe import experts_per_token, num_experts
    from models.partition import layer_param_counts
    from schema.compose import compose_config

    preset = compose_config([f"model={preset_name}"]).model
    config = config_from_preset(preset)  # the shipped preset, source cited
    check_preset(config, preset, "its config")  # its own config passes (rope_parameters: by the keys it names)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        hf = hub_shapes(model)
        seen = set()
        for layer in pipe_layers(config.num_hidden_layers, tie_word_embeddings=False):
            ours = {k: v.shape for k, v in build_layer(layer, config).state_dict().items()}
            keys = layer_keys(layer, config)
            assert set(ours) == set(keys)
            for k, hf_key in keys.items():
                assert ours[k] == hf[hf_key], hf_key
                seen.add(hf_key)
    assert seen == set(hf)
    key, shape, billions, per_token = PRESETS[preset_name]
    assert hf[key] == shape
    tied = config.tie_word_embeddings  # the head is the embedding: counted once
    total = sum(math.prod(shape) for key, shape in hf.items() if not (tied and key == "lm_head.weight"))
    assert round(total / 1e9, 2) == billions
    saved_buffers = sum(b.numel() for name, b in model.named_buffers() if name in model.state_dict())  # score biases
    counts = layer_param_counts(config)
    assert sum(counts) - tied * counts[-1] == total - saved_buffers  # every layer kind counted as it is built
    if per_token is not None:  # k of E routed experts
        routed = sum(math.prod(shape) for key, shape in hf.items() if ".experts." in key)
        active = total - routed * (1 - experts_per_token(config) / num_experts(config))
        assert round(active / 1e9, 2) == per_token
        per_layer = layer_param_counts(config, active=True)  # what memory_estimate prints (a tied head once)
        assert sum(per_layer) - tied * per_layer[-1] == active - saved_buffers


def hub_shapes(model) -> dict[str, tuple[int, ...]]:
    """{hub key: shape} of a transformers model (any device): its fused experts under the hub's per-expert keys."""
    from transformers.core_model_loading import revert_weight_conversion

    saved = revert_weight_conversion(model, model.state_dict())  # as save_pretrained; Kimi Linear's dense MLP: below
    return {hub_key(model.config, memory_key(model.config, k)): tuple(v.shape) for k, v in saved.items()}


def test_bin_checkpoint_and_dtype_cast(tmp_path, hf_models, tokenizer_dir):
    from transformers import AutoConfig, LlamaForCausalLM

    # Old-style sharded pytorch_model-*.bin with an index (transformers 5 writes only safetensors).
    src = str(tmp_path / "bin")
    shutil.copytree(hf_models["gqa"], src, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    model = LlamaForCausalLM.from_pretrained(hf_models["gqa"])
    state = model.state_dict()
    keys = list(state)
    shards = {
        "pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
        "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2 :],
    }
    for name, names in shards.items():
        torch.save({k: state[k].clone() for k in names}, os.path.join(src, name))
    weight_map = {k: name for name, names in shards.items() for k in names}
    json.dump({"weight_map": weight_map}, open(os.path.join(src, "pytorch_model.bin.index.json"), "w"))
    convert_hf_to_pipeline(src, str(tmp_path / "ckpt"), dtype="bf16", log=lambda *_: None)
    config = AutoConfig.from_pretrained(str(tmp_path / "ckpt"))
    got = load_hf_state_dict(str(tmp_path / "ckpt"), config)
    for k, v in model.state_dict().items():
        assert torch.equal(got[k], v.to(torch.bfloat16)), k
    assert json.load(open(tmp_path / "ckpt" / "config.json"))["dtype"] == "bfloat16"


def test_streaming_holds_about_one_layer(tmp_path):
    """Tensors held at once stay of the order of the largest layer, far below the model size (11 layer files)."""
    config = tiny_config(vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=8)
    src = make_hf_model(str(tmp_path / "hf"), config, max_shard_size="1MB")
    stats = convert_hf_to_pipeline(src, str(tmp_path / "ckpt"), log=lambda *_: None)
    layer_bytes = max(os.path.getsize(tmp_path / "ckpt" / "global_step0" / f) for f in stats.files)
    total = sum(os.path.getsize(tmp_path / "hf" / f) for f in os.listdir(tmp_path / "hf") if f.endswith(".safetensors"))
    assert stats.peak_pending_bytes <= 2 * layer_bytes  # a layer may straddle two shards
    assert stats.peak_pending_bytes < total / 5


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_recycled_read_buffers_never_mix_tensors(tmp_path, dtype):
    """Conversion reads into buffers recycled from layers already written (checkpoint/buffer_pool.py): every
    tensor of every layer still equals Hugging Face's (cast or not) bit for bit, with many layers and shards."""
    from transformers import AutoConfig

    config = tiny_config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=6)
    src = make_hf_model(str(tmp_path / "hf"), config, max_shard_size="300KB")
    convert_hf_to_pipeline(src, str(tmp_path / "ckpt"), dtype=dtype, log=lambda *_: None)
    got = load_hf_state_dict(str(tmp_path / "ckpt"), AutoConfig.from_pretrained(str(tmp_path / "ckpt")))
    shards = [f"{src}/{f}" for f in sorted(os.listdir(src)) if f.endswith(".safetensors")]
    want = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert len(os.listdir(src)) > 10 and got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v.to(torch.bfloat16) if dtype else v), k


def test_buffer_pool_reuses_only_its_own_buffers_within_the_peak():
    from checkpoint.buffer_pool import BufferPool

    pool = BufferPool()
    a, b = pool.take(1000), pool.take(400)
    a_ptr = a.data_ptr()
    pool.give(a.view(torch.int32)[10:])  # any view of a lent buffer returns it
    pool.give(torch.empty(1000, dtype=torch.uint8))  # not the pool's: ignored
    c = pool.take(1000)
    assert c.data_ptr() == a_ptr and c.numel() == 1000 and c.untyped_storage().nbytes() == 1000
    pool.give(c)
    pool.give(b)
    assert (pool.lent_bytes, pool.free_bytes, pool.peak_lent_bytes) == (0, 1400, 1400)
    d = pool.take(1200)  # a new size: free buffers go until the pool and the loans fit in the most ever lent
    assert pool.free_bytes + pool.lent_bytes <= pool.peak_lent_bytes and d.numel() == 1200


def test_a_config_reading_transformers_does_not_share_is_never_published(tmp_path, hf_models, monkeypatch):
    """Conversion writes from config.json fields read without transformers and checks them against transformers'
    reading before publishing: a difference (a wrong default, say) is refused by name and nothing is written."""
    import dataclasses

    import checkpoint.convert as convert
    from checkpoint.errors import CheckpointError
    from models.config import read_config_fields

    real = read_config_fields(hf_models["gqa"])
    wrong = dataclasses.replace(real, num_key_value_heads=real.num_key_value_heads + 1)
    monkeypatch.setattr(convert, "read_config_fields", lambda path: wrong)
    with pytest.raises(CheckpointError, match=r"config.json: read as num_key_value_heads=\d+ \(transformers reads"):
        convert_hf_to_pipeline(hf_models["gqa"], str(tmp_path / "ckpt"), log=lambda *_: None)
    assert os.listdir(tmp_path) == []


def _expect_error(args: list[str], fragment: str, out_dir: str | None = None):
    proc = run_cmd([sys.executable, "convert2ckpt.py", *args])
    assert proc.returncode == 2, proc.stderr
    one_error_line(proc, fragment, prefix="convert2ckpt: error:")
    if out_dir:
        assert not os.path.exists(out_dir)
        assert not [n for n in os.listdir(os.path.dirname(out_dir)) if ".tmp-" in n]


@pytest.mark.slow
def test_existing_output_is_refused_unless_forced(tmp_path, hf_models, converted):
    """(The other conversion errors are in tests/test_bad_inputs.py.)"""
    before = sorted(os.listdir(os.path.join(converted["gqa"], "global_step0")))
    _expect_error(["--input", hf_models["gqa"], "--output", converted["gqa"]], "already holds a pipeline checkpoint")
    assert sorted(os.listdir(os.path.join(converted["gqa"], "global_step0"))) == before
    forced = tmp_path / "forced"
    shutil.copytree(converted["gqa"], forced)
    proc = run_cmd([sys.executable, "convert2ckpt.py", "--input", hf_models["mha"], "--output", str(forced), "--force"])
    assert proc.returncode == 0, proc.stderr
    assert json.load(open(forced / "config.json"))["num_key_value_heads"] == 4


def test_outputs_follow_the_umask(tmp_path, hf_models):
    """Converted and exported directories and files get the modes `cp` and `save_pretrained` would give them
    (they were 0700, from a temporary directory renamed into place: teammates could not read them)."""
    import convert2ckpt

    src = tmp_path / "hf"
    shutil.copytree(hf_models["gqa"], src)
    for path in src.iterdir():
        path.chmod(0o664)
    old = os.umask(0o002)
    try:
        ckpt, out, tp2 = (str(tmp_path / n) for n in ("ckpt", "out", "tp2"))
        assert convert2ckpt.main(["--input", str(src), "--output", ckpt]) == 0
        assert convert2ckpt.main(["--to-hf", "--input", ckpt, "--output", out]) == 0
        assert convert2ckpt.main(["--input", ckpt, "--output", tp2, "--tp", "2"]) == 0
    finally:
        os.umask(old)
    for name in ("ckpt", "out", "tp2"):
        root = tmp_path / name
        modes = {str(p): p.stat().st_mode & 0o777 for p in [root, *root.rglob("*")]}
        wrong = {p: oct(m) for p, m in modes.items() if m != (0o775 if os.path.isdir(p) else 0o664)}
        assert not wrong and len(modes) > 5, wrong


def test_old_rotary_buffers_are_dropped(tmp_path, hf_models):
    """Old LLaMA checkpoints carry `rotary_emb.inv_freq` buffers: conversion drops them silently."""
    from safetensors.torch import save_file

    src = tmp_path / "old"
    shutil.copytree(hf_models["gqa"], src)
    save_file(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8) for i in range(4)},
        str(src / "rope.safetensors"),
    )
    index = json.load(open(src / "model.safetensors.index.json"))
    index["weight_map"].update(
        {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": "rope.safetensors" for i in range(4)}
    )
    json.dump(index, open(src / "model.safetensors.index.json", "w"))
    stats = convert_hf_to_pipeline(str(src), str(tmp_path / "ckpt"), log=lambda *_: None)
    assert stats.tensors == len(hf_state(hf_models["gqa"]))


@pytest.mark.slow
def test_pieces_by_layers_and_stages_combine_into_one_checkpoint(tmp_path, hf_models, converted):
    """Convert a model in pieces (as on several machines), combine: identical to a one-shot conversion."""
    src = hf_models["tied"]
    a, b, out = tmp_path / "a", tmp_path / "b", tmp_path / "whole"
    check = [sys.executable, "convert2ckpt.py", "--input", src]
    assert run_cmd([*check, "--output", str(a), "--layers", "0-2"]).returncode == 0
    proc = run_cmd([*check, "--output", str(b), "--stages", "1", "--num-stages", "2", "--partition", "2,2"])
    assert proc.returncode == 0, proc.stderr
    assert not (a / "latest").exists() and sorted(os.listdir(b / "global_step0"))[:3] == [
        "layer_03-model_00-model_states.pt",
        "layer_04-model_00-model_states.pt",
        "layer_05-model_00-model_states.pt",
    ]
    overlap = run_cmd([sys.executable, "convert2ckpt.py", "--combine", str(a), str(a), "--output", str(out)])
    assert overlap.returncode == 2 and "layer 0 is also in" in overlap.stderr and not out.exists()
    short = run_cmd([sys.executable, "convert2ckpt.py", "--combine", str(a), "--output", str(out)])
    assert short.returncode == 2 and "lack layer files [3, 4, 5]" in short.stderr
    damaged = tmp_path / "damaged"  # piece b after a bad copy between machines: one byte flipped
    shutil.copytree(b, damaged)
    victim = damaged / "global_step0" / "layer_04-model_00-model_states.pt"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0xFF
    victim.write_bytes(bytes(data))
    bad = run_cmd([sys.executable, "convert2ckpt.py", "--combine", str(a), str(damaged), "--output", str(out)])
    assert bad.returncode == 2 and f"{victim}: contents changed" in bad.stderr and not out.exists(), bad.stderr
    assert (
        run_cmd([sys.executable, "convert2ckpt.py", "--combine", str(a), str(b), "--output", str(out)]).returncode == 0
    )
    whole = os.path.join(converted["tied"], "global_step0")
    for name in os.listdir(whole):
        if name.startswith("layer_"):
            x = torch.load(os.path.join(whole, name), weights_only=True)
            y = torch.load(out / "global_step0" / name, weights_only=True)
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), name
    assert run_cmd([sys.executable, "convert2ckpt.py", "--verify", str(out)]).returncode == 0


def test_workers_write_the_same_files(tmp_path, hf_models, converted):
    stats = convert_hf_to_pipeline(hf_models["gqa"], str(tmp_path / "w"), workers=2, log=lambda *_: None)
    assert stats.layers_written == 7
    whole = os.path.join(converted["gqa"], "global_step0")
    for name in stats.files:
        x = torch.load(os.path.join(whole, name), weights_only=True)
        y = torch.load(tmp_path / "w" / "global_step0" / name, weights_only=True)
        assert all(torch.equal(x[k], y[k]) for k in x), name


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["llama", "phi3"])
def test_tp_split_and_merge_between_any_degrees_round_trip_bit_identical(model_type, tmp_path, tokenizer_dir):
    """A 6-head model (hidden 96): HF -> TP 2 -> TP 3 -> TP 6 -> TP 1 equals HF -> TP 1, file for file and bit for
    bit; TP 2 written as two pieces by --tp-ranks and combined equals HF -> TP 2; a TP 3 checkpoint verifies
    against the HF model and exports back to it exactly. Phi-3 (12 heads, 6 KV heads): its fused q/k/v rows in
    unequal parts and its fused gate/up, split part by part at every degree."""
    heads = dict(num_attention_heads=12, num_key_value_heads=6) if model_type == "phi3" else {}
    six_heads = tiny_config(
        model_type, hidden_size=96, intermediate_size=192, **dict(num_attention_heads=6, num_key_value_heads=6) | heads
    )
    hf = make_hf_model(str(tmp_path / "hf"), six_heads, tokenizer_dir=tokenizer_dir)
    cli = [sys.executable, "convert2ckpt.py"]
    run = [*cli, "--input", hf, "--output"]
    assert run_cmd([*run, str(tmp_path / "tp1")]).returncode == 0
    assert run_cmd([*run, str(tmp_path / "tp2"), "--tp", "2"]).returncode == 0
    previous = tmp_path / "tp2"
    for tp in (3, 6, 1):
        proc = run_cmd([*cli, "--input", str(previous), "--output", str(tmp_path / f"from{tp}"), "--tp", str(tp)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        previous = tmp_path / f"from{tp}"
    shards = sorted(os.listdir(tmp_path / "from6" / "global_step0"))
    assert "layer_01-model_05-model_states.pt" in shards and "layer_01-model_06-model_states.pt" not in shards

    def layer_files(ckpt):
        step = Path(ckpt) / "global_step0"
        return {f: torch.load(step / f, weights_only=True) for f in sorted(os.listdir(step)) if f.startswith("layer")}

    a, b = layer_files(tmp_path / "tp1"), layer_files(previous)
    assert a.keys() == b.keys() and all(a[f].keys() == b[f].keys() for f in a)
    assert all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    for ranks in ("0", "1"):
        assert run_cmd([*run, str(tmp_path / f"piece{ranks}"), "--tp", "2", "--tp-ranks", ranks]).returncode == 0
    proc = run_cmd(
        [*cli, "--combine", str(tmp_path / "piece0"), str(tmp_path / "piece1"), "--output", str(tmp_path / "combined")]
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = layer_files(tmp_path / "tp2"), layer_files(tmp_path / "combined")
    assert a.keys() == b.keys() and all(torch.equal(a[f][k], b[f][k]) for f in a for k in a[f])
    verify = run_cmd([*cli, "--verify", str(tmp_path / "from3"), "--against", hf])
    assert verify.returncode == 0 and verify.stdout.strip().endswith(": 0"), verify.stdout + verify.stderr
    back = tmp_path / "back"
    assert run_cmd([*cli, "--to-hf", "--input", str(tmp_path / "from3"), "--output", str(back)]).returncode == 0
    original, exported = hf_state(hf), hf_state(str(back))
    assert original.keys() == exported.keys() and all(torch.equal(original[k], exported[k]) for k in original)


@pytest.mark.parametrize(
    "family",
    [
        "llama4",
        "gemma3",
        "qwen3_5",
        "qwen3_5_moe",
        "kimi_k25",
        *("mistral3-mistral4", "mistral3-ministral3", "mistral3-mistral"),
        "gemma4",
        "llava-mistral",
        "llava_next-llama",
        "llava_onevision-qwen2",
        "internvl-qwen2",
        "idefics3-llama",
        "smolvlm-llama",
        *("qwen3_vl", "lfm2_vl", "glm4v_moe"),
    ],
)
def test_multimodal_checkpoint_converts_its_text_model(family, tmp_path):
    """A Llama4ForConditionalGeneration checkpoint (Llama 4 Scout, Maverick), a Gemma3ForConditionalGeneration one,
    a Qwen3_5ForConditionalGeneration one (every Qwen3.5, its `mtp.*` weights) or a Mistral3ForConditionalGeneration
    one (Mistral Small 4, untied; Ministral 3 and Mistral Small 3.x, tied by the container's config), and the
    vision-language ones (LLaVA's, InternVL, Idefics3, SmolVLM, Qwen3-VL, LFM2-VL, GLM-4.5V): conversion takes the text
    model (`text_config`, its keys under the container's prefix), keeps the rest aside; `--verify --against` the
    multimodal directory finds transformers' text logits (max difference 0), and the export is the multimodal
    checkpoint again, every tensor bit for bit, loaded by its class."""
    from tests.conftest import convert_in_process
    from tests.hub_extras import add_mtp_layer, add_unread_kv
    from tools.tiny_models import as_on_the_hub

    torch.manual_seed(0)
    model, vision_keys, text_type, architecture = multimodal(family)
    model.save_pretrained(tmp_path / "mm")
    if family.startswith("qwen3_5"):
        as_on_the_hub(str(tmp_path / "mm"), model.config.text_config)  # Qwen3.5-MoE's experts fused, as on the hub
        add_mtp_layer(str(tmp_path / "mm"), "mtp")
    if family == "kimi_k25":
        kimi_k25_as_on_the_hub(tmp_path / "mm")
    if family == "gemma4":  # the hub's k/v tensors of the layers that reuse K/V, which transformers skips at load
        add_unread_kv(str(tmp_path / "mm"))
    source = hf_state(str(tmp_path / "mm"))
    assert any(k.startswith(vision_keys) for k in source)
    ckpt, export = tmp_path / "ckpt", tmp_path / "export"
    assert convert_in_process(["--input", str(tmp_path / "mm"), "--output", str(ckpt)]).returncode == 0
    conf = json.loads((ckpt / "config.json").read_text())
    assert conf["model_type"] == text_type and conf["architectures"] == [architecture]
    verified = convert_in_process(["--verify", str(ckpt), "--against", str(tmp_path / "mm")])
    assert verified.returncode == 0 and "max |logit difference| against" in verified.stdout, verified.stdout
    assert verified.stdout.strip().endswith(": 0"), verified.stdout
    assert convert_in_process(["--to-hf", "--input", str(ckpt), "--output", str(export)]).returncode == 0
    exported = hf_state(str(export))
    # (compared as bytes, as FP8 tensors are; a 0-dim tensor, Gemma 4's audio clipping bounds, as a row of one)
    exported, source = ({k: v.reshape(-1) if v.dim() == 0 else v for k, v in d.items()} for d in (exported, source))
    assert set(exported) == set(source)
    assert all(torch.equal(exported[k].view(torch.uint8), v.view(torch.uint8)) for k, v in source.items())
    original = json.loads((tmp_path / "mm" / "config.json").read_text())
    assert json.loads((export / "config.json").read_text())["model_type"] == original["model_type"]
    type(model).from_pretrained(str(export))  # transformers loads it as the multimodal model it came from
    # read as another family's text model (Qwen3-VL's as Qwen3's): its logits on text rows are that one's
    assert text_type not in ALIASES or text_rows_compute_as(model, ALIASES[text_type], architecture)


def test_fused_hub_experts_convert_from_either_layout(tmp_path):
    """Qwen3.5-MoE's official checkpoints keep each layer's experts fused ([E, 2I, H] and [E, H, I], as transformers
    in memory); transformers' save_pretrained writes a new model's one key per expert. A directory of either converts
    to the same layer files, and exports in the hub's fused layout, bit for bit the official one's, which
    transformers loads as the same model."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import convert_in_process
    from tools.tiny_models import as_on_the_hub

    config = tiny_config("qwen3_5_moe_text", num_key_value_heads=2)
    fused, per_expert = str(tmp_path / "fused"), str(tmp_path / "per_expert")
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(per_expert)
    shutil.copytree(per_expert, fused)
    as_on_the_hub(fused, config)
    hub, saved = hf_state(fused), hf_state(per_expert)
    assert "model.layers.0.mlp.experts.gate_up_proj" in hub and "model.layers.0.mlp.experts.0.up_proj.weight" in saved
    assert not any(".experts.0." in k for k in hub) and not any(k.endswith("experts.down_proj") for k in saved)
    for name in ("fused", "per_expert"):
        src, ckpt, export = tmp_path / name, tmp_path / f"{name}_ckpt", tmp_path / f"{name}_export"
        assert convert_in_process(["--input", str(src), "--output", str(ckpt)]).returncode == 0
        assert convert_in_process(["--to-hf", "--input", str(ckpt), "--output", str(export)]).returncode == 0
        exported = hf_state(str(export))
        assert exported.keys() == hub.keys() and all(torch.equal(exported[k], v) for k, v in hub.items()), name
    ours, theirs = (
        load_hf_state_dict(str(tmp_path / "fused_ckpt")),
        load_hf_state_dict(str(tmp_path / "per_expert_ckpt")),
    )
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "fused_export")).named_parameters())
    assert all(torch.equal(loaded[k], p) for k, p in model.named_parameters())
