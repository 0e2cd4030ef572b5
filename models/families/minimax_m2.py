"""MiniMax-M2 (`minimax_m2`, MiniMax-M2 and M2.1): LLaMA's pre-norm layer with RMSNorms on q and k over the whole
projection (OLMo's `qk_norm_whole`: under tensor parallelism split with the heads, their statistics summed over the
ranks), partial RoPE (`rotary_dim` on the hub, transformers' `partial_rotary_factor`), and a sparse block in every
layer: a sigmoid router that chooses its top-k by score plus the block's `e_score_correction_bias` and always
renormalises the chosen weights, Mixtral's experts (one key each on the hub, `block_sparse_moe.experts.N.w1/w3/w2`,
fused in transformers' memory). transformers' load-balancing loss (with `output_router_logits`) counts the softmax
top-k of the router's logits, as Mixtral's, so the router statistics here do too (`router_choice` off). The hub's
`block_sparse_moe.e_score_correction_bias` is transformers' `mlp.e_score_correction_bias` (its conversion
mapping's renaming: `hub_renames`); it sits on the block, not the router, so `moe.bias_update_rate` is refused."""

from dataclasses import replace

from models.families import Family, register
from models.families.mixtral import MIXTRAL_MOE

register(
    Family(
        "minimax_m2",
        "MiniMaxM2",
        qk_norm=True,
        qk_norm_whole=True,
        moe=replace(MIXTRAL_MOE, block_bias="e_score_correction_bias"),
        hub_renames=True,
        # 4 experts (top-2), RoPE on half of each head (rotary_dim 8 of head_dim 16), as the hub's 64 of 128.
        tiny=dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, rotary_dim=8),
    )
)
