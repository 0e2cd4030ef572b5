"""Gemma 3 (`gemma3_text`: Gemma3ForCausalLM, the 1B model and the text of the larger ones).

What differs from LLaMA, each a generic rule of the registry or read from transformers: four RMSNorms per layer (input,
after attention, before and after the MLP; `post_attention_layernorm` normalises the attention's output, so only the
input and pre-MLP norms feed a tensor-parallel region), (1 + w) norms initialised at 0 (its RMSNorm class), per-head
q/k norms, embeddings scaled by sqrt(hidden_size) in the weights' dtype, the final logits soft-capped when
`final_logit_softcapping` is set, and RoPE tables per layer type (local `sliding_attention` layers with their own base
and window, global `full_attention` layers: `rotary(x, positions, layer_type)`). Attention scales queries by
`query_pre_attn_scalar` inside transformers' own attention. Bidirectional attention (`use_bidirectional_attention`,
for embedding models) is refused. Gemma3ForConditionalGeneration checkpoints (`gemma3`: Gemma 3 4B, 12B, 27B) convert
their text model: config.json's `text_config`, weights under `language_model.` (the vision tower is not read); the hub's
configs set no `final_logit_softcapping`, which transformers' multimodal forward would not apply (its text model does).
"""

from models.families import Container, Family, register, register_container

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

register(
    Family(
        "gemma3_text",
        "Gemma3",
        package="gemma3",
        config_name="Gemma3TextConfig",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        norms=NORMS,
        tp_entry_norms=("input_layernorm", "pre_feedforward_layernorm"),
        scaled_embedding=True,
        refused_fields={
            "use_bidirectional_attention": "bidirectional attention (an embedding model) is not a causal LM to "
            "train here"
        },
        # Local and global layers alternating (a window of 4 in rows of 12 and more), queries scaled by 1/4, logits
        # soft-capped at 2 (tiny models' logits reach it, so dropping the cap would show).
        tiny=dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            sliding_window_pattern=2,
            final_logit_softcapping=2.0,
            pad_token_id=0,
        ),
    )
)
register_container("gemma3", Container("text_config", "language_model.", "Gemma3ForCausalLM"))
