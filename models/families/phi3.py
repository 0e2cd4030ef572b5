"""Phi-3 and Phi-4 (`phi3`, Microsoft): q, k and v in one projection (`self_attn.qkv_proj`: q rows, then k, then v)
and gate and up in one (`mlp.gate_up_proj`: gate rows, then up), a window on every layer when `sliding_window` is set
(Phi-3-mini), RoPE on a part of each head where `partial_rotary_factor` < 1 (Phi-4-mini) inside transformers'
attention. Tensor parallelism is refused until the fused projections get their split (each part by heads / rows)."""

from models.families import Family, register

register(
    Family(
        "phi3",
        "Phi3",
        fused_qkv=True,
        fused_gate_up=True,
        window_everywhere=True,
        tp_refused="q/k/v and gate/up are fused projections",
        tiny=dict(pad_token_id=None),
    )
)
