"""OLMo 2 (`olmo2`, Ai2): each sublayer's output normalised before the residual add (`post_attention_layernorm`,
`post_feedforward_layernorm`; no norm before attention or the MLP), and RMSNorms on q and k over the whole projection
(all heads at once), q/k/v/o biases when `attention_bias`. Under tensor parallelism the q/k norms' weights split with
the heads and their statistics are summed over the ranks (`qk_norm_whole`); with no norm before attention or the
MLP, the split regions start at their inputs."""

from models.families import Family, register

OLMO2 = register(
    Family(
        "olmo2",
        "Olmo2",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        qk_norm_whole=True,
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        tp_entry_norms=(),
    )
)
