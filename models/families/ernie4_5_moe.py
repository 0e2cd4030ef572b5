"""ERNIE 4.5 MoE (`ernie4_5_moe`, Baidu: ERNIE-4.5-21B-A3B, 300B-A47B): ERNIE 4.5 dense's attention (interleaved RoPE;
`use_bias` refused in one line: transformers puts a bias on this family's LM head too, and no published checkpoint
sets it) and, every `moe_layer_interval`-th layer from `moe_layer_start_index` to
`moe_layer_end_index` (`MoeSpec.interval`), a sparse block: a softmax router in fp32 (its weight a bare parameter,
`mlp.gate.weight`) that chooses its top-k by the probabilities plus a frozen score bias (`moe_statics`, a
Parameter without gradient: on the hub `mlp.moe_statics.e_score_correction_bias`, transformers' conversion mapping
moves it under the router: `hub_renames`), top-k renormalised (clamped at `moe_norm_min`), ungated shared experts
(`mlp.shared_experts`, `moe_num_shared_experts` experts wide) and experts one key each on the hub. transformers'
load-balancing loss counts the softmax top-k of the router's logits, as Mixtral's, so the router statistics here do
too (`router_choice` off); the bias sits in its own module, so `moe.bias_update_rate` is refused."""

from dataclasses import replace

from models.families import MoeSpec, register
from models.families.ernie4_5 import ERNIE

register(
    replace(
        ERNIE,
        model_type="ernie4_5_moe",
        prefix="Ernie4_5_Moe",
        moe=MoeSpec(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            "moe_num_experts",
            "moe_intermediate_size",
            every_layer=False,
            interval=True,
            shared_expert=True,  # `shared_experts`
            shared_gate=False,
        ),
        hub_renames=True,
        # (transformers' ERNIE 4.5 MoE gives its head the bias too; the published checkpoints have none)
        refused_fields={"use_bias": "its LM head would take a bias (lm_head.bias), which the pipeline's head does not"},
        # 4 experts (top-2), one shared; layers 1 and 3 sparse (every 2nd from 1), 0 and 2 dense: each kind on each
        # of two stages.
        tiny=dict(
            head_dim=16,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=64,
            moe_num_shared_experts=1,
            moe_layer_start_index=1,
            moe_layer_interval=2,
        ),
    )
)
