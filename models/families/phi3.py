"""Phi-3 and Phi-4 (`phi3`, Microsoft): q, k and v in one projection (`self_attn.qkv_proj`: q rows, then k, then v)
and gate and up in one (`mlp.gate_up_proj`: gate rows, then up), a window on every layer when `sliding_window` is set
(Phi-3-mini), RoPE on a part of each head where `partial_rotary_factor` < 1 (Phi-4-mini) inside transformers'
attention. Under tensor parallelism each fused projection splits part by part (q, k, v by heads; gate and up by
rows: models/sharding.py's parts rules), which is what transformers' layer built with heads / T holds."""

from models.families import Family, register

register(
    Family(
        "phi3",
        "Phi3",
        fused_qkv=True,
        fused_gate_up=True,
        window_everywhere=True,
        tiny=dict(pad_token_id=None),
    )
)
