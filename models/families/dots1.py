"""dots.llm1 (`dots1`, rednote hi lab): Qwen3's attention (per-head q/k RMSNorms, q/k/v/o biases when
`attention_bias`) with DeepSeek-V3's sparse blocks: dense MLPs in the first `first_k_dense_replace` layers, then the
sigmoid router choosing its own experts (`e_score_correction_bias` for the choice only, group-limited top-k, weights
scaled by `routed_scaling_factor`) and ungated shared experts; transformers adds no load-balancing loss."""

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "dots1",
        "Dots1",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        moe=DEEPSEEK_MOE,
        tiny=DEEPSEEK_TINY | dict(head_dim=16),
    )
)
