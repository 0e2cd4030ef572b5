"""Qwen2-MoE (`qwen2_moe`): Qwen2's attention (q/k/v biases when `qkv_bias`), sparse layers every
`decoder_sparse_step` except `mlp_only_layers`, experts one key each (`mlp.experts.N.gate_proj/up_proj/down_proj`)
and a sigmoid-gated shared expert (`mlp.shared_expert`, `mlp.shared_expert_gate`)."""

from models.families import Family, MoeSpec, register

# Qwen's sparse blocks with a gated shared expert (Qwen3-Next's and Qwen3.5's too).
QWEN_SHARED_MOE = MoeSpec(
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "num_experts",
    "moe_intermediate_size",
    every_layer=False,
    shared_expert=True,
)

register(
    Family(
        "qwen2_moe",
        "Qwen2Moe",
        qkv_bias="qkv_bias",
        moe=QWEN_SHARED_MOE,
        tiny=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96),
    )
)
