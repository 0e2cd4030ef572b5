"""Qwen3-MoE (`qwen3_moe`): Qwen3's attention (per-head q/k norms), sparse layers as Qwen2-MoE's, no shared expert,
top-k weights renormalised with `norm_topk_prob`."""

from models.families import Family, MoeSpec, register

register(
    Family(
        "qwen3_moe",
        "Qwen3Moe",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        window_everywhere=True,
        moe=MoeSpec(
            "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", every_layer=False
        ),
        tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    )
)
