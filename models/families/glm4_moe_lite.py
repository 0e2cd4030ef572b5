"""GLM-4.7-Flash (`glm4_moe_lite`, Z.ai): DeepSeek-V3's multi-head latent attention (low-rank queries and keys/values,
value heads narrower than query heads, interleaved RoPE) and DeepSeek's sparse blocks (the sigmoid router with
`e_score_correction_bias`, group-limited top-k, `routed_scaling_factor`, shared experts), the dense and sparse
layers listed by `mlp_layer_types` (the hub's: the first dense, the rest sparse). DeepSeek-V3's record with that
one rule (`MoeSpec.layer_types`): no second implementation of MLA or of the router."""

from dataclasses import replace

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "glm4_moe_lite",
        "Glm4MoeLite",
        o_bias="attention_bias",
        moe=replace(DEEPSEEK_MOE, first_dense="", layer_types="mlp_layer_types"),
        # DeepSeek-V3's tiny MLA; layers 0 and 2 dense, 1 and 3 sparse (a dense layer between sparse ones).
        tiny={k: v for k, v in DEEPSEEK_TINY.items() if k != "first_k_dense_replace"}
        | dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
        | dict(mlp_layer_types=["dense", "sparse", "dense", "sparse"]),
    )
)
