"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's architecture (models/families/deepseek_v32.py: multi-head latent attention
with DeepSeek Sparse Attention, DeepSeek's router and shared experts after dense first layers) with the indexer shared
across layers: a "full" layer (`indexer_types`) runs its lightning indexer and passes its top-k keys on, each
"shared" layer after it attends those keys without an indexer of its own (transformers' `prev_topk_indices`). The
index is carried between stages (models/carry.py, int32 [B, S, topk]: no gradient) from its full layer to the last
shared layer reading it, wherever the cut falls. Its indexer applies interleaved RoPE (transformers' own); it is
frozen as V3.2's is (transformers computes it without gradients). Context parallelism and flash-attn are refused as
for V3.2. The multi-token-prediction layer past the last decoder layer is carried (`num_nextn_predict_layers`)."""

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "glm_moe_dsa",
        "GlmMoeDsa",
        o_bias="attention_bias",
        moe=DEEPSEEK_MOE,
        always_mask=True,
        flash_refused="transformers runs its sparse attention in eager or SDPA only",
        frozen=("self_attn.indexer",),
        carries=("shared_index",),
        cp_refused="indexer scores every key of the row for each query, and a context-parallel rank holds its own "
        "positions' keys only",
        # DeepSeek-V3's tiny MLA and V3.2's indexer (16 heads of 16 keeping 4 keys a query); layers 0 and 1 run the
        # indexer, 2 and 3 share layer 1's choice (at PP=2 the index crosses the cut, at PP=4 two).
        tiny=DEEPSEEK_TINY
        | dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
        | dict(index_n_heads=16, index_head_dim=16, index_topk=4, indexer_types=["full", "full", "shared", "shared"]),
    )
)
