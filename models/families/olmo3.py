"""OLMo 3 (`olmo3`, Ai2): OLMo 2's layer (norms after each sublayer, q/k norms over the whole projection) with
local layers (`layer_types` "sliding_attention") attending within `sliding_window` and global layers. Tensor
parallelism is refused as for OLMo 2."""

from models.families import Family, register

register(
    Family(
        "olmo3",
        "Olmo3",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        tp_entry_norms=(),
        tp_refused="its q/k norms normalise the whole projection, across heads",
        tiny=dict(sliding_window=4),  # local layers' window shorter than the test rows
    )
)
