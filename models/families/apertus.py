"""Apertus (`apertus`, Swiss AI): LLaMA's attention with per-head q/k RMSNorms and q/k/v/o biases when
`attention_bias`, its norms named `attention_layernorm` and `feedforward_layernorm`, and an MLP without a gate:
`down_proj(xIELU(up_proj(x)))`, the xIELU activation's two trained scalars per layer (`mlp.act_fn.alpha_p`,
`alpha_n`, replicated under TP; its `beta` and `eps` saved buffers)."""

from models.families import Family, register

NORMS = ("attention_layernorm", "feedforward_layernorm")

register(
    Family(
        "apertus",
        "Apertus",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        norms=NORMS,
        tp_entry_norms=NORMS,
        tiny=dict(head_dim=16),
    )
)
