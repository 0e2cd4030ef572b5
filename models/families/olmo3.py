"""OLMo 3 (`olmo3`, Ai2): OLMo 2's layer (norms after each sublayer, q/k norms over the whole projection) with
local layers (`layer_types` "sliding_attention") attending within `sliding_window` and global layers; split over
tensor-parallel ranks as OLMo 2 is."""

from models.families import Family, register

register(
    Family(
        "olmo3",
        "Olmo3",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        qk_norm_whole=True,
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        tp_entry_norms=(),
        tiny=dict(sliding_window=4),  # local layers' window shorter than the test rows
    )
)
