"""Mistral 4 (`mistral4`: Mistral Small 4's text model): DeepSeek-V3's architecture, multi-head latent attention
with interleaved RoPE and queries scaled by position (`rope_parameters.llama_4_scaling_beta`, as Ministral 3's),
dense MLPs in the first `first_k_dense_replace` layers, then sparse blocks with shared experts, whose router scores
by a softmax (no score bias: `moe.bias_update_rate` is refused) before DeepSeek's group-limited top-k and
`routed_scaling_factor`. The hub keeps each layer's experts fused as transformers does in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), the router at `mlp.gate`. Under tensor
parallelism MLA splits by heads as DeepSeek-V3's, the experts' gate and up rows and down's columns as the other
families' fused experts."""

from dataclasses import replace

from models.families import Container, Family, register, register_container
from models.families.deepseek_v3 import DEEPSEEK_MOE, DEEPSEEK_TINY
from models.families.ministral3 import TINY_ROPE

register(
    Family(
        "mistral4",
        "Mistral4",
        o_bias="attention_bias",
        moe=replace(DEEPSEEK_MOE, score_bias=False, hub_fused=True),
        # MLA at hidden 64 as DeepSeek-V3's tiny model; queries scaled from position 8 on.
        tiny=DEEPSEEK_TINY
        | dict(
            q_lora_rank=32,
            kv_lora_rank=24,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=12,
            rope_parameters=TINY_ROPE | dict(partial_rotary_factor=8 / 24),
        ),
    )
)

# The hub's Mistral Small 4 checkpoints are multimodal (Mistral3ForConditionalGeneration, as are Ministral 3's and
# Mistral Small 3.x's, holding their families' text models): the text model's keys under `language_model.` as
# transformers 5 still saves them, the Pixtral vision tower and the projector (`vision_tower.`,
# `multi_modal_projector.`) carried. Their FP8 weights (one scale per tensor) are dequantized at conversion
# (checkpoint/dequantize.py).
register_container("mistral3", Container("text_config", "language_model."))
