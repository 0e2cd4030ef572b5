"""Hunyuan dense (`hunyuan_v1_dense`, Tencent Hunyuan 0.5B-7B): LLaMA's layer with per-head RMSNorms on q and k
after RoPE (`self_attn.query_layernorm`, `key_layernorm`), q/k/v/o biases when `attention_bias`. Its config class
names no tensor-parallel plan and its q/k norms carry other names than the generic rule's, so tensor parallelism is
refused in one line until that split is built; PP, DP and CP run."""

from models.families import Family, register

HUNYUAN = register(
    Family(
        "hunyuan_v1_dense",
        "HunYuanDenseV1",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        tp_refused="its per-head q/k norms (query_layernorm, key_layernorm) are not in the tensor-parallel split rules",
        tiny=dict(head_dim=16),
    )
)
