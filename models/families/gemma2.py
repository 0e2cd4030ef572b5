"""Gemma 2 (`gemma2`): Gemma 3's layer without q/k norms, with attention logits soft-capped
(`attn_logit_softcapping`, inside transformers' attention: it runs the family eager, SDPA cannot cap) and the final
logits soft-capped (`final_logit_softcapping`). The generic rules are Gemma 3's: four norms per layer ((1 + w),
initialised at 0), scaled embeddings, local (`sliding_attention`) and global layers alternating, queries scaled by
`query_pre_attn_scalar`, tied embeddings."""

from models.families import Family, register
from models.families.gemma3_text import NORMS

register(
    Family(
        "gemma2",
        "Gemma2",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        norms=NORMS,
        tp_entry_norms=("input_layernorm", "pre_feedforward_layernorm"),
        scaled_embedding=True,
        # Local layers with a window of 4, queries scaled by 1/4, attention logits capped at 2 and final logits at 2
        # (tiny models' logits reach both, so dropping a cap would show).
        tiny=dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=2.0,
        ),
    )
)
