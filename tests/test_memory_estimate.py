"""The memory planner against measurement: bytes autograd saves per micro-batch, and parameter bytes, per stage."""

from __future__ import annotations

import pytest
import torch

from models.key_table import pipe_layers
from models.layers import DecoderOptions, build_layer
from models.partition import layer_param_counts, stage_bounds
from tools.memory_estimate import stage_activation_bytes
from tools.tiny_models import tiny_config


def measured_stage(config, layers: range, b: int, s: int, options: DecoderOptions, dtype) -> tuple[int, int]:
    """(bytes of the distinct tensors saved for backward in one micro-batch's forward, parameters) of a stage."""
    torch.manual_seed(0)
    specs = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    modules = [build_layer(specs[i], config, options).to(dtype) for i in layers]
    params = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    position_ids = torch.arange(s).repeat(b, 1)
    if options.packed:  # two documents per row
        position_ids = torch.cat([torch.arange(s // 2), torch.arange(s - s // 2)]).repeat(b, 1)
    x = (torch.randint(0, config.vocab_size, (b, s)), position_ids)
    if layers[0] != 0:  # a later stage receives hidden states
        x = (torch.randn(b, s, config.hidden_size, dtype=dtype, requires_grad=True), position_ids)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for module in modules:
            x = module(x)
    return sum(saved.values()), sum(p.numel() for m in modules for p in m.parameters())


LAYOUTS = {  # (config overrides, attention, stages, stage, packed, checkpoint every k, dtype)
    "mha-pp1": ({}, "sdpa", 1, 0, False, 0, torch.float32),
    "gqa-pp2-stage0": ({"num_key_value_heads": 2}, "sdpa", 2, 0, False, 0, torch.float32),
    "gqa-pp2-stage1": ({"num_key_value_heads": 2}, "sdpa", 2, 1, False, 0, torch.float32),
    "eager-pp1": ({}, "eager", 1, 0, False, 0, torch.float32),
    "packed-sdpa-pp1": ({}, "sdpa", 1, 0, True, 0, torch.float32),
    "recompute2-pp1": ({}, "sdpa", 1, 0, False, 2, torch.float32),
    "wide-bf16-pp2-stage1": ({"hidden_size": 256, "intermediate_size": 688}, "sdpa", 2, 1, False, 0, torch.bfloat16),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_activation_and_parameter_estimates_match_measurement(layout):
    overrides, attn, stages, stage, packed, every, dtype = LAYOUTS[layout]
    config = tiny_config(**{"hidden_size": 128, "intermediate_size": 344, "num_attention_heads": 4, **overrides})
    config._attn_implementation = attn
    b, s = 2, 96
    bounds = stage_bounds(config, stages, "uniform")
    layers = range(bounds[stage], bounds[stage + 1])
    measured, params = measured_stage(config, layers, b, s, DecoderOptions(packed, every), dtype)
    act_bytes = 4 if dtype == torch.float32 else 2
    kept, live = stage_activation_bytes(config, layers, b, s, 1, act_bytes, attn, packed, every)
    print(f"{layout}: predicted {kept / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB "
          f"({kept / measured - 1:+.1%})")  # fmt: skip
    assert abs(kept / measured - 1) <= 0.05
    assert params == sum(layer_param_counts(config)[bounds[stage] : bounds[stage + 1]])
