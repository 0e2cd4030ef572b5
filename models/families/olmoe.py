"""OLMoE (`olmoe`, Ai2): LLaMA's pre-norm layer with RMSNorms on q and k over the whole projection (OLMo's: under
tensor parallelism split with the heads, their statistics summed over the ranks), q/k/v clipped at `clip_qkv` where
set (inside its attention), q/k/v/o biases when `attention_bias`, and a sparse block in every layer: a softmax router
over `num_experts` experts of width `intermediate_size`, top-k (`num_experts_per_tok`) renormalised when
`norm_topk_prob`, experts one key each on the hub and fused in transformers' memory; transformers' load-balancing
loss (`router_aux_loss_coef`, with `output_router_logits`)."""

from models.families import Family, MoeSpec, register

# A sparse block in every layer, experts of `intermediate_size` (FlexOlmo's too).
OLMOE_MOE = MoeSpec("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "intermediate_size", every_layer=True)

register(
    Family(
        "olmoe",
        "Olmoe",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        qk_norm_whole=True,
        moe=OLMOE_MOE,
        # q/k/v clipped at 0.5 (tiny models' states reach it, so ignoring the clip would show).
        tiny=dict(num_experts=4, num_experts_per_tok=2, head_dim=16, clip_qkv=0.5),
    )
)
