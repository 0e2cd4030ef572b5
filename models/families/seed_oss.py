"""Seed-OSS (`seed_oss`, ByteDance): LLaMA's layer with q/k/v biases when `attention_bias`, an o_proj bias when
`attention_out_bias`, MLP biases when `mlp_bias`, and dropout on each residual branch (`residual_dropout`, 0.1 in
its config class: applied in training as transformers applies it, and replayed on recompute)."""

from models.families import Family, register

register(
    Family(
        "seed_oss",
        "SeedOss",
        qkv_bias="attention_bias",
        o_bias="attention_out_bias",
        mlp_bias="mlp_bias",
        tiny=dict(residual_dropout=0.0, head_dim=16),  # the tiny model is compared with transformers step by step
    )
)
