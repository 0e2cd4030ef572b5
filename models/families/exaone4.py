"""EXAONE 4.0 (`exaone4`, LG AI Research): OLMo 2's layout (each sublayer's output normalised before the residual
add, `post_attention_layernorm` and `post_feedforward_layernorm`, no norm before attention or the MLP) with per-head
RMSNorms on q and k, local layers (`layer_types` "sliding_attention", window `sliding_window`) and global layers
without RoPE (transformers' attention skips it where the layer is global and a window is set: the 32B model's
3:1 pattern). Under tensor parallelism the q/k norms are replicated (transformers' plan: their gradients summed over
the ranks) and the split regions start at the attention's and the MLP's own inputs."""

from models.families import Family, register

register(
    Family(
        "exaone4",
        "Exaone4",
        qk_norm=True,
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        tp_entry_norms=(),
        # Local layers with a window of 4 then a global NoPE layer (its 3:1 pattern), so both matter at 12 tokens.
        tiny=dict(head_dim=16, sliding_window=4, sliding_window_pattern=2),
    )
)
