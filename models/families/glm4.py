"""GLM-4 (`glm4`, Zhipu: GLM-4-9B, GLM-4-32B-0414): q/k/v biases (`attention_bias`, on by default), four norms
per layer (the attention's and the MLP's outputs are normalised again before each residual add:
`post_self_attn_layernorm`, `post_mlp_layernorm`), gate and up in one projection (`mlp.gate_up_proj`), RoPE on half
of each head (`partial_rotary_factor` 0.5) inside transformers' attention. Under tensor parallelism the fused
gate/up projection splits half by half."""

from models.families import Family, register

register(
    Family(
        "glm4",
        "Glm4",
        qkv_bias="attention_bias",
        norms=("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm"),
        tp_entry_norms=("input_layernorm", "post_attention_layernorm"),
        fused_gate_up=True,
        tiny=dict(head_dim=16, pad_token_id=None),
        config_defaults=dict(attention_bias=True),  # Glm4Config's
    )
)
