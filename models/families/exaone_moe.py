"""K-EXAONE (`exaone_moe`, LG AI Research): EXAONE 4's attention (per-head q/k norms, local layers and global layers
without RoPE) in LLaMA's pre-norm layer, with DeepSeek's sparse blocks (the sigmoid router with its score bias,
group-limited top-k, `routed_scaling_factor`, shared experts) in the layers `mlp_layer_types` lists as sparse. The
hub keeps the score bias on the block (`mlp.e_score_correction_bias`), transformers in the router
(`mlp.gate.e_score_correction_bias`: its conversion mapping's renaming, `hub_renames`); `mtp.*` carried."""

from dataclasses import replace

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "exaone_moe",
        "ExaoneMoe",
        qk_norm=True,
        moe=replace(DEEPSEEK_MOE, num_experts="num_experts", first_dense="", layer_types="mlp_layer_types"),
        hub_renames=True,
        # DeepSeek's tiny router and experts under this family's field names (layer 0 dense: its config lists
        # `mlp_layer_types` from `first_k_dense_replace`); local layers (window 4) and a global NoPE layer every 2nd.
        tiny={k: v for k, v in DEEPSEEK_TINY.items() if k not in ("n_routed_experts", "n_shared_experts")}
        | dict(num_experts=4, num_shared_experts=1, head_dim=16, sliding_window=4, sliding_window_pattern=2),
    )
)
