"""Seed-OSS (`seed_oss`, ByteDance): LLaMA's layer with q/k/v biases when `attention_bias`, an o_proj bias when
`attention_out_bias`, MLP biases when `mlp_bias`, and dropout on each residual branch and on attention weights
(`residual_dropout`, `attention_dropout`: 0.1 each in its config class; applied in training as transformers applies
them, replayed on recompute; set them to 0 in config.json to fine-tune without)."""

from models.families import Family, register

register(
    Family(
        "seed_oss",
        "SeedOss",
        qkv_bias="attention_bias",
        o_bias="attention_out_bias",
        mlp_bias="mlp_bias",
        # The tiny model is compared with transformers step by step: no dropout.
        tiny=dict(residual_dropout=0.0, attention_dropout=0.0, head_dim=16),
    )
)
