"""Qwen3.5 (`qwen3_5_text`, the text model of `qwen3_5` Qwen3_5ForConditionalGeneration checkpoints) and Qwen3.5-MoE
(`qwen3_5_moe_text`, of `qwen3_5_moe`): Qwen3-Next's hybrid of Gated DeltaNet linear attention and gated full
attention (models/families/qwen3_next.py: the same generic rules and refusals), a dense MLP in every layer (Qwen3.5)
or a sparse block with a gated shared expert in every layer (Qwen3.5-MoE, its experts fused on the hub as in memory:
transformers' one-key-per-expert saves are read too, checkpoint/expert_layouts.py); the rotary embedding of the
multimodal model (`TextRotaryEmbedding`), which gives text positions the same angle on all three of its grids."""

from models.families import Container, Family, MoeSpec, register, register_container
from models.families.qwen3_next import HYBRID_TINY

for model_type, package, prefix, moe, tiny in (
    ("qwen3_5_text", "qwen3_5", "Qwen3_5", None, {}),
    (
        "qwen3_5_moe_text",
        "qwen3_5_moe",
        "Qwen3_5Moe",
        MoeSpec(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            "num_experts",
            "moe_intermediate_size",
            every_layer=True,
            shared_expert=True,
            hub_fused=True,  # the official checkpoints' (transformers' save_pretrained writes one key per expert)
        ),
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    ),
):
    register(
        Family(
            model_type,
            prefix,
            package=package,
            config_name=prefix + "TextConfig",
            class_names={"RotaryEmbedding": "TextRotaryEmbedding"},
            qkv_bias="attention_bias",
            o_bias="attention_bias",
            qk_norm=True,
            moe=moe,
            tiny=HYBRID_TINY | tiny,
        )
    )

# The hub's Qwen3.5 checkpoints are multimodal: the text model's keys under `model.language_model.` (its head at
# `lm_head.`), the vision tower under `model.visual.` and the multi-token-prediction weights under `mtp.`, carried.
for container, text in (("qwen3_5", "Qwen3_5ForCausalLM"), ("qwen3_5_moe", "Qwen3_5MoeForCausalLM")):
    register_container(
        container,
        Container("text_config", "", text, renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."))),
    )
