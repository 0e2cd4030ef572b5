"""GLM-4.5 / GLM-4.6 (`glm4_moe`): LLaMA's layer with q/k/v biases (`attention_bias`), optional per-head q/k norms
(`use_qk_norm`) and partial RoPE; dense MLPs in the first `first_k_dense_replace` layers, sparse blocks after with
DeepSeek's router (sigmoid scores, `e_score_correction_bias` for the choice only, group-limited top-k, weights
renormalised and scaled by `routed_scaling_factor`) and ungated shared experts (`mlp.shared_experts`). transformers
adds no load-balancing loss. The multi-token-prediction layers past the last decoder layer are carried unchanged
(`num_nextn_predict_layers`)."""

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "glm4_moe",
        "Glm4Moe",
        qkv_bias="attention_bias",
        qk_norm="use_qk_norm",
        moe=DEEPSEEK_MOE,
        tiny=DEEPSEEK_TINY | dict(head_dim=16),
    )
)
