"""Qwen2 / Qwen2.5 (`qwen2`): q, k and v biases always; layers marked "sliding_attention" in `config.layer_types`
(`use_sliding_window`, `max_window_layers`) attend within `sliding_window`."""

from models.families import Family, register

register(Family("qwen2", "Qwen2", qkv_bias=True))
