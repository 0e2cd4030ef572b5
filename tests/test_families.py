"""Each supported family's pipeline layers, on transformers' own classes, give transformers' logits bit for bit
(single process, fast); the key table covers each family's keys exactly; other model types are refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.config import ConfigFields, differing_field, load_hf_config, read_config_fields
from models.key_table import all_layer_keys, pipe_layers
from models.layers import DecoderOptions, build_layer, split_stats, tied_lm_head_forward
from tests.conftest import LLAMA3_ROPE, hf_state
from tools.tiny_models import tiny_config

FAMILY_CONFIGS = {
    "llama-biases-head_dim": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-biases": ("qwen3", dict(attention_bias=True)),
    # Mixture of experts (4 experts, top-2): Mixtral's window; Qwen2-MoE's gated shared expert with dense layers
    # between sparse ones (decoder_sparse_step); Qwen3-MoE's renormalised top-k and a layer kept dense.
    "mixtral-window": ("mixtral", dict(sliding_window=5)),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(decoder_sparse_step=2)),
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], head_dim=24)),
    # Llama 4: chunks of 4 (shorter than the row), a NoPE layer with temperature tuning that acts from position 3
    # (floor_scale 4), L2 q/k norms, a dense layer between sparse ones, the shared expert, sigmoid top-2 routing.
    "llama4-chunked-nope": ("llama4_text", dict(no_rope_layer_interval=3, interleave_moe_layer_step=2)),
    # Families built like LLaMA, one file each in models/families/: their own bias fields, NoPE layers (SmolLM3),
    # position-scaled queries (Ministral 3), interleaved RoPE (ERNIE 4.5).
    "helium-biases": ("helium", dict(attention_bias=True, mlp_bias=True)),
    "smollm3-nope-biases": ("smollm3", dict(attention_bias=True, mlp_bias=True)),
    "smollm3-sliding": ("smollm3", dict(use_sliding_window=True, sliding_window=4)),
    "ministral3-scaled-window": ("ministral3", dict(sliding_window=5)),
    "ministral3": ("ministral3", {}),
    "seed_oss-biases": ("seed_oss", dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)),
    "ernie4_5-biases": ("ernie4_5", dict(use_bias=True)),
}


def pipeline_logits(config, state: dict, ids: torch.Tensor) -> torch.Tensor:
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    keys = all_layer_keys(config)
    modules = []
    for layer in layers:
        if layer.has_file:
            module = build_layer(layer, config, DecoderOptions())
            module.load_state_dict({ours: state[hf] for ours, hf in keys[layer.index].items()})
            modules.append(module.eval())
    x = (ids, torch.arange(ids.shape[1]).expand_as(ids))
    with torch.no_grad():
        for module in modules:
            x = module(x)
        x = tied_lm_head_forward(modules[0], x) if config.tie_word_embeddings else x
        return split_stats(x)[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", list(FAMILY_CONFIGS))
def test_family_layers_equal_transformers_bit_for_bit(name, attn, tmp_path):
    from transformers import AutoModelForCausalLM

    model_type, overrides = FAMILY_CONFIGS[name]
    config = tiny_config(model_type, num_hidden_layers=3, num_key_value_heads=2, **overrides)
    config._attn_implementation = attn
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.save_pretrained(tmp_path)  # the hub's keys: one per expert where transformers fuses them in memory
    state = hf_state(str(tmp_path))
    # The table's keys are exactly the checkpoint's (the tied head's weight lives in the embedding's file).
    table = {hf_key for keys in all_layer_keys(config).values() for hf_key in keys.values()}
    assert table == set(state)
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
    assert torch.equal(pipeline_logits(config, state, ids), reference)
    if "window" in name or "sliding" in name:  # the window matters at this length: ignoring it would show
        full = tiny_config(
            model_type,
            num_hidden_layers=3,
            num_key_value_heads=2,
            **{k: v for k, v in overrides.items() if "window" not in k},
        )
        full._attn_implementation = attn
        assert not torch.equal(pipeline_logits(full, state, ids), reference)
    if "chunked" in name:  # the chunk and the temperature matter at this length: ignoring either would show
        for ignored in (dict(attention_chunk_size=64), dict(attn_temperature_tuning=False)):
            other = tiny_config(model_type, num_hidden_layers=3, num_key_value_heads=2, **overrides | ignored)
            other._attn_implementation = attn
            assert not torch.equal(pipeline_logits(other, state, ids), reference)


def test_other_model_types_are_refused(tmp_path):
    for model_type in ("deepseek_v3", "gpt_oss"):  # experts behind attention we do not build (MLA, sinks)
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
        supported = (
            "supported: ernie4_5, helium, llama, llama4, llama4_text, ministral3, mistral, mixtral, qwen2, qwen2_moe, "
            "qwen3, qwen3_moe, seed_oss, smollm3"
        )
        with pytest.raises(ValueError, match=f"model_type='{model_type}' is not supported \\({supported}\\)"):
            load_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "sliding_window": 4096}))
    with pytest.raises(ValueError, match="model_type='llama' with sliding_window=4096"):
        load_hf_config(str(tmp_path))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "helium", "smollm3", "ministral3"])
def test_config_fields_read_without_transformers_equal_transformers_reading(model_type, tmp_path):
    """What conversion reads of config.json before transformers is imported equals transformers' own reading,
    for every family, with each key that has a default left out of the file (the defaults are transformers')."""
    config = tiny_config(model_type, num_key_value_heads=2, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    full = json.loads((tmp_path / "config.json").read_text())
    optional = [f.name for f in dataclasses.fields(ConfigFields) if f.default is not dataclasses.MISSING]
    for left_out in [None, *optional]:
        (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != left_out}))
        light = read_config_fields(str(tmp_path))
        assert light is not None and differing_field(light, load_hf_config(str(tmp_path))) is None, left_out
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in full.items() if k != "num_hidden_layers"}))
    assert read_config_fields(str(tmp_path)) is None  # no default: only transformers knows (it assumes 32)
