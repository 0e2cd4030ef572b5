"""FlexOlmo (`flex_olmo`, Ai2): OLMo 2's layer (each sublayer's output normalised before the residual add, q/k norms
over the whole projection: under tensor parallelism split with the heads, their statistics summed over the ranks)
with OLMoE's sparse block in every layer (a softmax router, top-k renormalised when `norm_topk_prob`, experts one key
each on the hub) and transformers' load-balancing loss."""

from models.families import Family, MoeSpec, register

register(
    Family(
        "flex_olmo",
        "FlexOlmo",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        qk_norm_whole=True,
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        tp_entry_norms=(),
        moe=MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "intermediate_size", every_layer=True),
        # (its config's pad token, 100277, is past a tiny vocabulary)
        tiny=dict(num_experts=4, num_experts_per_tok=2, head_dim=16, pad_token_id=None),
    )
)
