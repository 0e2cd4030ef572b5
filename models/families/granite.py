"""Granite (`granite`, IBM Granite 3.x dense): LLaMA's layer with muP's multipliers: embeddings times
`embedding_multiplier`, each sublayer's output times `residual_multiplier` and attention scores times
`attention_multiplier` (both inside transformers' decoder layer), logits divided by `logits_scaling`. The first and
the last are generic rules (`Family.embedding_multiplier`, `Family.logits_divisor`: the embedding and every head,
tied, vocab-parallel or fused with the loss, apply them as transformers does)."""

from models.families import Family, register

register(
    Family(
        "granite",
        "Granite",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        embedding_multiplier="embedding_multiplier",
        logits_divisor="logits_scaling",
        # Granite 3.3 8B's multipliers (so each one shows at this size).
        tiny=dict(head_dim=16, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125)
        | dict(logits_scaling=16.0),
    )
)
