"""DeepSeek-V3.2 (`deepseek_v32`: V3.2-Exp, V3.2): DeepSeek-V3's architecture (models/families/deepseek_v3.py) with
DeepSeek Sparse Attention. A lightning indexer per layer (`self_attn.indexer`: `wq_b` from the query's low-rank
latent, `wk` with a LayerNorm, `weights_proj`, half-split RoPE on its first `qk_rope_head_dim` dims) scores every key
for every query, and each query attends only its `index_topk` best keys within the causal mask. The indexer reads
that mask, so it is built even on unpacked rows (`always_mask`). transformers computes the indexer without gradients
(DeepSeek trains it with a loss of its own, which transformers has not): its weights stay as loaded (`frozen`), are
saved and exported unchanged. Under tensor parallelism it is replicated (its input, the query latent, is whole on
every rank), and every rank chooses the same keys for its heads. Context parallelism is refused (each rank would
score its own positions only). Keys that tie for a query's last places (every indexer head's ReLU at 0 scores a key
exactly 0) are chosen by `torch.topk`, whose choice among equals may change with the row's padded length: so it does
in transformers' own model (a row alone and the same row padded in a batch can attend different keys)."""

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY

register(
    Family(
        "deepseek_v32",
        "DeepseekV32",
        o_bias="attention_bias",
        moe=DEEPSEEK_MOE,
        always_mask=True,
        flash_refused="transformers runs its sparse attention in eager or SDPA only",
        frozen=("self_attn.indexer",),
        cp_refused="indexer scores every key of the row for each query, and a context-parallel rank holds its own "
        "positions' keys only",
        # DeepSeek-V3's tiny MLA, and an indexer of 16 heads of 16 keeping 4 keys a query (rows of 16: really sparse).
        tiny=DEEPSEEK_TINY
        | dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
        | dict(index_n_heads=16, index_head_dim=16, index_topk=4),
    )
)
