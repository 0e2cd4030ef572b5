"""LLaMA 1/2/3.x (`llama`): the reference shape. Optional q/k/v/o biases (`attention_bias`), MLP biases (`mlp_bias`),
an explicit `head_dim`, `rope_type: llama3` scaling. A `sliding_window` in its config.json is refused: LLaMA
attention has none, and a Mistral checkpoint relabelled `llama` would silently lose its window."""

from models.families import Family, register

register(
    Family(
        "llama",
        "Llama",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        refused_fields={
            "sliding_window": "LLaMA attention has no sliding window and would silently drop it (a Mistral model "
            "relabelled? model_type should be 'mistral')"
        },
    )
)
