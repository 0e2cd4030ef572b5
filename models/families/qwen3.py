"""Qwen3 (`qwen3`): per-head RMSNorm on q and k (`self_attn.q_norm`, `k_norm`), an explicit `head_dim`, optional
q/k/v/o biases (`attention_bias`), sliding layers as Qwen2's."""

from models.families import Family, register

register(Family("qwen3", "Qwen3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True))
