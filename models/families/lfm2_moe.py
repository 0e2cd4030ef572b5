"""LFM2-MoE (`lfm2_moe`: LFM2-8B-A1B, LFM2-24B-A2B): LFM2's short convolutions beside attention
(models/families/lfm2.py: the same layers, norms, refusals) with dense MLPs in the first `num_dense_layers` layers and
sparse blocks after, all under `feed_forward`: a sigmoid router that chooses its top-k by score plus the block's
`expert_bias` (a buffer, on the block rather than the router, so `moe.bias_update_rate` is refused), renormalises
where `norm_topk_prob` and scales by `routed_scaling_factor`; Mixtral-named experts on the hub
(`feed_forward.experts.N.w1/w3/w2`, fused in transformers' memory). transformers trains it with no load-balancing
loss; the router statistics count the experts the router chose. Tensor parallelism splits LFM2's layers as LFM2's,
the experts as a dense MLP is (each expert's gate and up rows, down columns), the router replicated."""

from models.families import Family, MoeSpec, register
from models.families.lfm2 import LFM2_LAYERS, LFM2_TINY

register(
    Family(
        "lfm2_moe",
        "Lfm2Moe",
        **LFM2_LAYERS,
        moe=MoeSpec(
            "feed_forward",
            ("w1", "w3", "w2"),
            "num_experts",
            "moe_intermediate_size",
            every_layer=False,
            first_dense="num_dense_layers",
            router_choice=True,
            block="feed_forward",
            aux_loss=False,
            block_bias="expert_bias",
        ),
        # A dense first layer, then sparse blocks of 4 experts (top-2) with the block's score bias.
        tiny=LFM2_TINY | dict(num_dense_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    )
)
