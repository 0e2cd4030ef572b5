"""Hunyuan MoE (`hunyuan_v1_moe`, Tencent Hunyuan-A13B): Hunyuan dense's attention (per-head q/k norms after RoPE,
`query_layernorm` / `key_layernorm`; tensor parallelism refused as for the dense family) and a sparse block in every
layer: a softmax router in fp32 (`mlp.gate.wg`, top-k renormalised), experts one key each on the hub and fused in
transformers' memory, and a shared MLP every token goes through (`mlp.shared_mlp`); transformers adds no
load-balancing loss."""

from dataclasses import replace

from models.families import MoeSpec, register
from models.families.hunyuan_v1_dense import HUNYUAN

register(
    replace(
        HUNYUAN,
        model_type="hunyuan_v1_moe",
        prefix="HunYuanMoEV1",
        moe=MoeSpec(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            "num_experts",
            "intermediate_size",
            every_layer=True,
            shared_expert=True,  # `shared_mlp`, of the dense MLP's width
            shared_gate=False,
            always_renormalise=True,
            aux_loss=False,
        ),
        tiny=dict(head_dim=16, num_experts=4, moe_topk=2),
    )
)
