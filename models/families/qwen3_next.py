"""Qwen3-Next (`qwen3_next`: Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet linear attention (`linear_attn`: a
causal depthwise convolution, then a gated delta-rule recurrence per value head, a gated RMSNorm; transformers' pure
torch path on CPU, its fused kernels where installed) and, every `full_attention_interval`-th layer, gated full
attention (`self_attn`: q_proj also yields an output gate, per-head q/k norms, partial RoPE), as `layer_types` says;
(1 + w) norms; sparse blocks as Qwen2-MoE's (a sigmoid-gated shared expert). The recurrence runs along the whole row:
packed rows and context parallelism are refused for it in one line (`linear_attention_refusal`). Tensor parallelism
splits it by heads (models/tp_rules.py: its projections group each key head's q, k, v, z and b, a rows together, so
a rank's rows are one contiguous block). Its hub checkpoints' multi-token-prediction weights (`mtp.*`) are carried
to the export (checkpoint/carried.py)."""

from models.families import Family, register
from models.families.qwen2_moe import QWEN_SHARED_MOE

# The tiny test model's linear attention: 2 key and 4 value heads of 16; layers 0-2 linear, 3 full (Qwen3.5's too).
HYBRID_TINY = dict(
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    full_attention_interval=4,
    shared_expert_intermediate_size=96,
)

register(
    Family(
        "qwen3_next",
        "Qwen3Next",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        moe=QWEN_SHARED_MOE,
        # Layers 0-2 linear attention, 3 full; 4 experts, top-2, a shared expert; 2 key and 4 value heads of 16.
        tiny=HYBRID_TINY | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    )
)
