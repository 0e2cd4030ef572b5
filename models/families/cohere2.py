"""Cohere 2 (`cohere2`, Command R7B, Command A): a parallel block (attention and the MLP both read one LayerNorm's
output, their sum added to the residual: `parallel_block`, one tensor-parallel entry), LayerNorms without a bias
(`Cohere2LayerNorm`, the final norm too), interleaved RoPE on the sliding-window layers and none on the global ones,
q/k/v/o biases when `attention_bias`, and logits times `logit_scale` (`logits_multiplier`: every head, tied,
vocab-parallel and fused with the loss)."""

from models.families import Family, register

register(
    Family(
        "cohere2",
        "Cohere2",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        norms=("input_layernorm",),
        tp_entry_norms=("input_layernorm",),
        parallel_block=True,
        logits_multiplier="logit_scale",
        class_names={"RMSNorm": "LayerNorm"},
        # Sliding layers (window 4) and a global NoPE layer every 2nd; logits scaled by 0.5 as the hub's 0.25-1.0.
        tiny=dict(head_dim=16, sliding_window=4, sliding_window_pattern=2, logit_scale=0.5),
    )
)
