"""DeepSeek-V3 / V3.1 / V3.2's dense-attention text model and R1 (`deepseek_v3`; Kimi K2's text model is the same
architecture): multi-head latent attention (MLA: queries through a low-rank `q_a_proj` -> `q_a_layernorm` ->
`q_b_proj`, or one `q_proj` without `q_lora_rank`; keys and values from one compressed `kv_a_proj_with_mqa` ->
`kv_a_layernorm` -> `kv_b_proj`, the rope part of the key shared by every head; value heads narrower than query
heads; interleaved RoPE with `rope_interleave`), dense MLPs in the first `first_k_dense_replace` layers, then sparse
blocks with the sigmoid router (`e_score_correction_bias`, group-limited top-k, `routed_scaling_factor`) and
shared experts. Under tensor parallelism MLA splits by heads (`q_b_proj`, `kv_b_proj` by rows, `o_proj` by
columns); its low-rank projections and their norms are replicated. The multi-token-prediction layer past the last
decoder layer is carried unchanged (`num_nextn_predict_layers`).

Kimi K2's checkpoints (`model_type: kimi_k2`) are this architecture and are read as it; Kimi K2.5's (`kimi_k25`,
Kimi_K25ForConditionalGeneration) hold it as their text model: `text_config`, weights under `language_model.` (the
vision tower and projector carried). Kimi K2 Thinking's and K2.5's routed experts are INT4 on the hub
(compressed-tensors), dequantized at conversion (checkpoint/dequantize.py)."""

from models.families import Container, Family, MoeSpec, register, register_alias, register_container

# DeepSeek's sparse blocks (GLM-4.5's too): experts one key each, the sigmoid router choosing its own experts,
# ungated shared experts, dense first layers; transformers adds no load-balancing loss.
DEEPSEEK_MOE = MoeSpec(
    "mlp",
    ("gate_proj", "up_proj", "down_proj"),
    "n_routed_experts",
    "moe_intermediate_size",
    every_layer=False,
    first_dense="first_k_dense_replace",
    router_choice=True,
    score_bias=True,
    shared_expert=True,
    shared_gate=False,
    aux_loss=False,
)
# 4 experts in 2 groups (1 chosen), top-2 scaled by 2.5; the first layer dense.
DEEPSEEK_TINY = dict(
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)

register(
    Family(
        "deepseek_v3",
        "DeepseekV3",
        o_bias="attention_bias",
        moe=DEEPSEEK_MOE,
        # MLA at hidden 64: 4 heads of 16 + 8 (rope) query dims, 12 value dims, ranks 32 (q) and 24 (kv).
        tiny=DEEPSEEK_TINY
        | dict(q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12),
    )
)
register_alias("kimi_k2", "deepseek_v3")
register_container("kimi_k25", Container("text_config", "language_model.", "DeepseekV3ForCausalLM"))
