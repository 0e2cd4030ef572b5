"""The tiny configurations each family's layers are held to transformers with, bit for bit
(tests/test_families.py, and on a GPU tests/test_gpu.py): every bias and norm on, so a dropped key shows, and
windows, soft-caps and chunks that matter at 12 tokens, so ignoring one shows."""

from tests.conftest import LLAMA3_ROPE

FAMILY_CONFIGS = {
    "llama-biases-head_dim": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=24)),
    "llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral-window": ("mistral", dict(sliding_window=5)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen2-sliding-layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3-biases": ("qwen3", dict(attention_bias=True)),
    # Mixture of experts (4 experts, top-2): Mixtral's window; Qwen2-MoE's gated shared expert with dense layers
    # between sparse ones (decoder_sparse_step); Qwen3-MoE's renormalised top-k and a layer kept dense.
    "mixtral-window": ("mixtral", dict(sliding_window=5)),
    "qwen2_moe-sparse-step": ("qwen2_moe", dict(decoder_sparse_step=2)),
    "qwen3_moe-norm-topk": ("qwen3_moe", dict(norm_topk_prob=True, mlp_only_layers=[1], head_dim=24)),
    # Llama 4: chunks of 4 (shorter than the row), a NoPE layer with temperature tuning that acts from position 3
    # (floor_scale 4), L2 q/k norms, a dense layer between sparse ones, the shared expert, sigmoid top-2 routing.
    "llama4-chunked-nope": ("llama4_text", dict(no_rope_layer_interval=3, interleave_moe_layer_step=2)),
    # Families built like LLaMA, one file each in models/families/: their own bias fields, NoPE layers (SmolLM3),
    # position-scaled queries (Ministral 3), interleaved RoPE (ERNIE 4.5).
    "helium-biases": ("helium", dict(attention_bias=True, mlp_bias=True)),
    "smollm3-nope-biases": ("smollm3", dict(attention_bias=True, mlp_bias=True)),
    "smollm3-sliding": ("smollm3", dict(use_sliding_window=True, sliding_window=4)),
    "ministral3-scaled-window": ("ministral3", dict(sliding_window=5)),
    "ministral3": ("ministral3", {}),
    "seed_oss-biases": ("seed_oss", dict(attention_bias=True, attention_out_bias=True, mlp_bias=True)),
    "ernie4_5-biases": ("ernie4_5", dict(use_bias=True)),
    # Gemma 3 (registry rules: four norms, scaled embeddings, soft-capped logits, RoPE per layer type): local layers
    # with a window of 4, tied embeddings as Gemma ships them.
    "gemma3-local-softcap": ("gemma3_text", {}),
    "gemma3-tied": ("gemma3_text", dict(tie_word_embeddings=True)),
    # Fused projections (Phi-3: q/k/v and gate/up; GLM-4: gate/up, with its four norms and half-head RoPE), norms
    # after each sublayer with q/k norms over the whole projection (OLMo 2, OLMo 3 with local layers).
    "phi3-window": ("phi3", dict(sliding_window=5)),
    "phi3-partial-rope": ("phi3", dict(partial_rotary_factor=0.5)),
    "glm4": ("glm4", {}),
    "olmo2-biases": ("olmo2", dict(attention_bias=True)),
    "olmo3-local": ("olmo3", {}),
    # DeepSeek's router (sigmoid scores plus `e_score_correction_bias` for the choice, 2 groups of which 1 is chosen,
    # weights scaled by 2.5), a dense first layer, shared experts: GLM-4.5 with q/k norms, biases and partial RoPE;
    # DeepSeek-V3's MLA with low-rank queries and interleaved RoPE, and with one q_proj and RoPE by halves.
    "glm4_moe-qk-norm-biases": ("glm4_moe", dict(use_qk_norm=True, attention_bias=True)),
    "deepseek_v3-mla": ("deepseek_v3", dict(num_key_value_heads=4)),
    "deepseek_v3-mla-q-proj": ("deepseek_v3", dict(num_key_value_heads=4, q_lora_rank=None, rope_interleave=False)),
    "deepseek_v32-sparse-attention": ("deepseek_v32", dict(num_key_value_heads=4)),
    # Mistral 4: DeepSeek-V3's MLA with queries scaled by position (from position 8), a softmax router (2 groups of
    # which 1 is chosen, weights scaled by 2.5), experts fused on the hub as in memory.
    "mistral4-mla-scaled": ("mistral4", dict(num_key_value_heads=4)),
    # gpt-oss: attention sinks (eager), sliding (window 4) and full layers, every bias, interleaved gate/up experts
    # with biases, the router's bias, the clamped SwiGLU (limit 0.5 so it clamps at this size).
    "gpt_oss-sinks-local": ("gpt_oss", dict(swiglu_limit=0.5)),
    # Qwen3-Next: Gated DeltaNet linear attention (layers 0-2) and gated full attention (3), (1 + w) norms, sparse
    # blocks with a gated shared expert; rows of 12 tokens run the recurrence in chunks of 64 (transformers' own).
    "qwen3_next-hybrid": ("qwen3_next", dict(num_hidden_layers=4)),
    "qwen3_5-hybrid": ("qwen3_5_text", dict(num_hidden_layers=4)),
    "qwen3_5_moe-hybrid": ("qwen3_5_moe_text", dict(num_hidden_layers=4)),
    # State shared across layers (models/carry.py): Gemma 4's per-layer inputs and K/V reused by its last two layers
    # (local layers with a window of 4), its 31B-like shape (neither); GLM-5's index shared by layers 2 and 3.
    "gemma4-ple-shared-kv": ("gemma4_text", dict(num_hidden_layers=6, num_key_value_heads=4)),
    "gemma4-31b-like": (
        "gemma4_text",
        dict(num_hidden_layers=6, num_key_value_heads=4, num_kv_shared_layers=0),
    ),
    "glm_moe_dsa-shared-index": ("glm_moe_dsa", dict(num_hidden_layers=4, num_key_value_heads=4)),
    "gemma4-moe": (
        "gemma4_text",
        dict(num_hidden_layers=6, num_key_value_heads=4, enable_moe_block=True, num_experts=4),
    ),
    # One module each (issue 62's first): EXAONE 4's post-sublayer norms with per-head q/k norms, local layers (window
    # 4) and a global NoPE layer; Gemma 2's four norms with attention and final logits soft-capped (eager), local
    # layers; Hunyuan's q/k norms after RoPE with biases; InternLM3 as transformers runs it (LLaMA's layers); Granite's
    # muP multipliers (embedding, residual, attention, logits).
    "exaone4-local": ("exaone4", {}),
    "gemma2-local-softcap": ("gemma2", {}),
    "hunyuan_v1_dense-biases": ("hunyuan_v1_dense", dict(attention_bias=True)),
    "internlm3-biases": ("internlm3", dict(attention_bias=True, mlp_bias=True)),
    "granite-mup-biases": ("granite", dict(attention_bias=True, mlp_bias=True)),
    # OLMoE: OLMo's whole-projection q/k norms, q/k/v clipped, a softmax router in every layer; dots.llm1: Qwen3's
    # attention with DeepSeek's router (score biases, groups), a dense first layer and shared experts.
    "olmoe-clip-biases": ("olmoe", dict(attention_bias=True)),
    "olmoe-renormalised": ("olmoe", dict(norm_topk_prob=True)),
    "dots1-biases": ("dots1", dict(attention_bias=True)),
    "flex_olmo-biases": ("flex_olmo", dict(attention_bias=True)),  # OLMo 2's layer with OLMoE's experts
    "minimax_m2-partial-rope": ("minimax_m2", {}),  # whole-projection q/k norms, the block's score bias
    "glm4_moe_lite-mla-biases": ("glm4_moe_lite", dict(num_key_value_heads=4, attention_bias=True)),  # by layer type
    "apertus-biases-xielu": ("apertus", dict(attention_bias=True)),  # its xIELU scalars moved off their init
    "exaone_moe-local-nope": ("exaone_moe", {}),  # EXAONE 4's attention, DeepSeek's router by layer type
    "hunyuan_v1_moe-biases": ("hunyuan_v1_moe", dict(attention_bias=True)),  # q/k norms after RoPE, shared MLP
    "mimo_v2_flash-sinks-local": ("mimo_v2_flash", dict(attention_bias=True)),  # narrower values, sinks, window 4
    "ernie4_5_moe-interval": ("ernie4_5_moe", {}),  # sparse by interval, a frozen score bias, shared experts
    "cohere2-local-biases": ("cohere2", dict(attention_bias=True)),  # parallel block, LayerNorms, logit_scale
    "lfm2-conv-biases": ("lfm2", dict(num_hidden_layers=4)),  # gated short convolutions (0, 2) beside attention
    "lfm2_moe-conv-biases": ("lfm2_moe", dict(num_hidden_layers=4)),  # ... with DeepSeek-like experts after layer 0
    # Granite 4: Mamba-2 (layers 0, 2) beside NoPE attention (1, 3), a shared MLP and experts, muP multipliers; dense
    # with RoPE
    "granitemoehybrid-mamba-mup": ("granitemoehybrid", dict(num_hidden_layers=4, attention_bias=True)),
    "granitemoehybrid-with-rope-dense": (
        "granitemoehybrid",
        dict(num_hidden_layers=4, position_embedding_type="rope", num_local_experts=0),
    ),
    # Falcon-H1: Mamba-2 beside attention in every layer, muP multipliers inside and out, every bias
    "falcon_h1-mamba-multipliers": ("falcon_h1", dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True)),
    # Nemotron-H: Mamba-2, sparse (gateless experts, DeepSeek's router), NoPE attention and MLP blocks, twice over
    "nemotron_h-mamba-experts-nope": ("nemotron_h", {}),
    "nemotron_h-mamba-dense": ("nemotron_h", dict(layers_block_type=["linear_attention", "full_attention", "mlp"] * 2)),
    # Kimi Linear: Kimi Delta Attention (its q/k/v short convolutions three tensors on the hub) beside NoPE latent
    # attention, a dense first layer, then DeepSeek's router over Mixtral-named experts with a shared expert
    "kimi_linear-kda-conv-mla": ("kimi_linear", dict(num_hidden_layers=4, num_key_value_heads=4)),
    # DeepSeek-V4: 3 residual streams, sliding / compressed sparse / heavily compressed attention, hash and top-k
    # routers (the tokens carried to hash layers 0, 1 and 3), its hub's own key names.
    "deepseek_v4-streams-hash": ("deepseek_v4", dict(num_hidden_layers=6, num_key_value_heads=1)),
}
