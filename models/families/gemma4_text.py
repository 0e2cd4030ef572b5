"""Gemma 4 (`gemma4_text`: Gemma4ForCausalLM, and the text model of the `gemma4` Gemma4ForConditionalGeneration
checkpoints: E2B, E4B, 31B, 26B-A4B).

Gemma 3's registry rules (four norms per layer, embeddings scaled by sqrt(H), soft-capped logits, RoPE per layer
type: local `sliding_attention` layers with their window, global `full_attention` layers with proportional RoPE on a
quarter of a head) plus what is Gemma 4's own, read from transformers' config and layer:

- layers of two shapes (`per_layer_config`: global layers with `global_head_dim` and, with `attention_k_eq_v`, their
  own `num_global_key_value_heads`, the value projection dropped: values are the keys before their norm);
- per-layer embeddings (PLE, `hidden_size_per_layer_input`: E2B, E4B): every layer adds a gated projection of its
  own input slice, made from `embed_tokens_per_layer` and a projection of the embeddings (models/carry.py: made in
  block 0, whose layer file holds those model-level tensors, and carried to every later block);
- K/V sharing (`num_kv_shared_layers`: the last layers reuse the keys and values of the last layer of their type that
  computes its own; models/carry.py carries them across stages, their gradient back to their maker), reusing layers'
  MLPs twice as wide with `use_double_wide_mlp`; the hub keeps k/v projections and norms for the reusing layers,
  which transformers skips at load: carried aside and written back on export;
- `layer_scalar`, a saved buffer scaling each layer's output.

Under tensor parallelism the heads split per layer shape; the PLE modules and each layer's per-layer gate and
projection are replicated (their gradients summed over TP under sequence parallelism, as the norms'). With
`enable_moe_block` (26B-A4B) every layer runs experts beside its dense MLP, each with norms of its own, their outputs
summed (`GEMMA4_MOE`: the layer itself the sparse block; under TP the experts split as a dense MLP does and their
output is summed over TP before its norm; under expert parallelism the tokens travel to their experts by all-to-all).
Bidirectional attention (`use_bidirectional_attention`, for embedding and vision-language models) is refused.
"""

from models.families import Container, Family, MoeSpec, register, register_container

# The MoE block's own norms: before the experts (their input: it enters the TP split region), after the dense MLP and
# after the experts (whole outputs), besides the four of every layer and the per-layer inputs' norm.
MOE_NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")
NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_per_layer_input_norm",
    *MOE_NORMS,
)
# 26B-A4B's experts: in every layer beside the dense MLP (the layer itself their block), fused on the hub as in
# memory ([E, 2I, H], [E, H, I]); a router of its own (a scale-free norm, a scale per channel and per expert; softmax,
# top-k renormalised, then scaled per expert) returning probabilities; transformers adds no load-balancing loss.
GEMMA4_MOE = MoeSpec(
    "",
    ("gate_proj", "up_proj", "down_proj"),
    "num_experts",
    "moe_intermediate_size",
    every_layer=True,
    router_choice=True,
    block="",
    router="router",
    hub_fused=True,
    aux_loss=False,
    top_k="top_k_experts",
    router_probabilities=True,
    beside_mlp=True,
)

register(
    Family(
        "gemma4_text",
        "Gemma4",
        package="gemma4",
        config_name="Gemma4TextConfig",
        class_names={
            "DecoderLayer": "TextDecoderLayer",
            "RotaryEmbedding": "TextRotaryEmbedding",
            "ScaledWordEmbedding": "TextScaledWordEmbedding",
            "Model": "TextModel",
        },
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        qk_norm=True,
        norms=NORMS,
        tp_entry_norms=("input_layernorm", "pre_feedforward_layernorm", "pre_feedforward_layernorm_2"),
        moe=GEMMA4_MOE,
        moe_when="enable_moe_block",
        scaled_embedding=True,
        carries=("per_layer_inputs", "shared_kv"),
        config_defaults={"tie_word_embeddings": True},  # Gemma4TextConfig's, where config.json leaves it out
        flash_refused="its global layers' heads of global_head_dim=512 are wider than flash-attn's 256",
        refused_fields={
            "use_bidirectional_attention": "bidirectional attention (an embedding or vision-language model's) is not "
            "a causal LM to train here",
        },
        # Local (window 4) and global layers alternating, the global ones with heads twice as wide and half as many
        # K/V heads (values = keys), per-layer inputs of 8, the last two layers reusing K/V (and MLPs twice as
        # wide), logits soft-capped at 2 (tiny models' logits reach it).
        tiny=dict(
            num_hidden_layers=6,
            layer_types=["sliding_attention", "full_attention"] * 3,
            head_dim=16,
            global_head_dim=32,
            num_key_value_heads=4,
            num_global_key_value_heads=2,
            attention_k_eq_v=True,
            hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=64,
            num_kv_shared_layers=2,
            use_double_wide_mlp=True,
            sliding_window=4,
            final_logit_softcapping=2.0,
            pad_token_id=0,
            num_experts=4,  # (with enable_moe_block: 4 experts of 32, top-2, beside the MLP in every layer)
            top_k_experts=2,
            moe_intermediate_size=32,
        ),
    )
)
# The hub's Gemma 4 checkpoints are multimodal: the text model under `model.language_model.` (its head tied), the
# vision and audio towers and their projections under `model.vision_tower.`, `model.embed_vision.`, ... carried.
register_container(
    "gemma4",
    Container(
        "text_config", "", "Gemma4ForCausalLM", renames=(("model.language_model.", "model."), ("lm_head.", "lm_head."))
    ),
)
