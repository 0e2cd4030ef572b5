"""SmolLM3 (`smollm3`): LLaMA's layer whose attention skips RoPE on the layers `no_rope_layers` marks 0 (NoPE, every
`no_rope_layer_interval`-th layer by default), q/k/v/o biases when `attention_bias`, MLP biases when `mlp_bias`, and
layers marked "sliding_attention" (with `use_sliding_window`) attending within `sliding_window`. Its attention reads
the rotary tables only on RoPE layers, so the pipeline layer hands them to every layer as transformers does."""

from models.families import Family, register

register(
    Family(
        "smollm3",
        "SmolLM3",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        tiny=dict(no_rope_layer_interval=2, pad_token_id=None),  # a NoPE layer on each of two stages
        config_defaults=dict(tie_word_embeddings=True),  # SmolLM3Config's
    )
)
