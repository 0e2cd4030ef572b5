"""LFM2 (`lfm2`: Liquid's LFM2-350M to 2.6B): a hybrid of gated short convolutions (`conv`: in_proj makes B, C and x,
a causal depthwise convolution of `conv_L_cache` taps runs over B * x, C gates its output, out_proj; transformers'
pure torch path on CPU, causal-conv1d where installed) and grouped-query attention with per-head q/k norms
(`q_layernorm`, `k_layernorm`; `out_proj`), as `layer_types` says ("conv" or "full_attention"); a SwiGLU MLP under
`feed_forward` (w1, w3, w2) whose width transformers derives from `intermediate_size` (`block_auto_adjust_ff_dim`);
norms `operator_norm` and `ffn_norm`, the final one `model.embedding_norm`, eps `norm_eps`. The convolution carries a
state along the row: packed rows and context parallelism are refused for it in one line, as for linear attention.
Tensor parallelism splits the convolution by channels (in_proj's B, C and x rows part by part, the depthwise
convolution's channels with them, out_proj row-parallel), attention by heads (`out_proj` row-parallel, the per-head
q/k norms replicated), the MLP as any (w1 and w3 by rows, w2 by columns)."""

from models.families import Family, register

# Short convolutions in layers 0 and 2, attention in 1 and 3 (each kind on each of two stages), their biases on; an
# epsilon other than the tiny models' rms_norm_eps, so that reading the wrong one shows; the MLP's width derived by
# transformers (intermediate_size 128 -> 256).
LFM2_TINY = dict(
    layer_types=["conv", "full_attention", "conv", "full_attention"],
    norm_eps=1e-6,
    conv_bias=True,
)

# What LFM2-MoE's layers share with LFM2's (models/families/lfm2_moe.py)
LFM2_LAYERS = dict(
    norms=("operator_norm", "ffn_norm"),
    tp_entry_norms=("operator_norm", "ffn_norm"),
    final_norm="embedding_norm",
    mlp="feed_forward",
)

register(Family("lfm2", "Lfm2", **LFM2_LAYERS, tiny=LFM2_TINY))
