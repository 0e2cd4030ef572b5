"""The 4-rank training layouts that tests/test_training.py (and the resume, schedule and move tests built on it)
hold to a single-process transformers reference. A layout's name says what it adds: `-ep2` expert parallelism,
`-cp2` context parallelism, `-tiled` DeepSpeed's TiledMLP, `-balanced` DeepSeek-V3's bias balancing."""

# (model, activation_checkpointing, stages, TP, rows arranged: "", "packing" or "concatenate", model.loss_chunk_size)
LAYOUTS = {
    "gqa-pp2-dp2": ("gqa", "false", 2, 1, "", 0),
    "tied-pp2-dp2": ("tied", "false", 2, 1, "", 0),
    # Packed rows against the reference's unpacked rows; every 2nd block recomputed; loss 5 tokens at a time.
    "gqa-pp2-dp2-packed-recompute2-chunked": ("gqa", "2", 2, 1, "packing", 5),
    # Documents end to end in blocks (data.concatenate) against each block's pieces run as rows of their own.
    "tied-pp2-dp2-concatenated": ("tied", "false", 2, 1, "concatenate", 0),
    "gqa-pp2-tp2-chunked": ("gqa", "false", 2, 2, "", 7),  # chunks through the vocab-parallel loss
    "tied-tp2-dp2-recompute": ("tied", "true", 1, 2, "", 0),
    # The other families: Qwen3's per-head q/k norms under TP, Qwen2's biases (tied), Mistral's sliding window.
    "qwen3-pp2-tp2": ("qwen3", "false", 2, 2, "", 0),
    "qwen2-tp2-dp2-recompute": ("qwen2", "true", 1, 2, "", 0),
    "mistral-pp2-dp2": ("mistral", "false", 2, 1, "", 0),
    # Mixture of experts, transformers' load-balancing loss on (coefficient 0.1) across stages: Mixtral's experts
    # split over EP=2 (2 of 4 per rank, tokens sent by all-to-all), its sparse blocks recomputed; Qwen3-MoE's experts
    # split over TP with sequence parallelism and the chunked vocab-parallel loss; Qwen2-MoE's gated shared expert
    # (every 2nd layer sparse, tied embeddings) with its experts split over TP=2 and EP=2 at once.
    "mixtral-pp2-dp2-ep2-recompute": ("mixtral", "true", 2, 1, "", 0),
    # DP=4 x EP=2: each expert held by 2 DP ranks, whose gradients are summed over that expert-data group.
    "mixtral-dp4-ep2": ("mixtral", "false", 1, 1, "", 0),
    "qwen3_moe-pp2-tp2-chunked": ("qwen3_moe", "false", 2, 2, "", 5),
    "qwen2_moe-tp2-dp2-ep2": ("qwen2_moe", "false", 1, 2, "", 0),
    # Llama 4 (no load-balancing loss in transformers): chunked and NoPE layers, dense layers between sparse ones,
    # the shared expert; its experts split over EP=2 across two stages, and over TP=2 x EP=2 with sequence parallelism.
    "llama4-pp2-dp2-ep2": ("llama4", "false", 2, 1, "", 0),
    "llama4-tp2-dp2-ep2": ("llama4", "false", 1, 2, "", 0),
    # Context parallelism C=2 (Ulysses; DP=1): packed rows whose documents cross the shard boundary, every block
    # recomputed, the loss 5 tokens at a time, the MLPs in 3 tiles (DeepSpeed's TiledMLP), over two stages;
    # Mistral's sliding window under TP=2 with sequence parallelism (the row cut into C x T = 4 pieces).
    "gqa-pp2-cp2-packed-recompute-chunked-tiled": ("gqa", "true", 2, 1, "packing", 5),
    "mistral-tp2-cp2": ("mistral", "false", 1, 2, "", 0),
    # Experts under context parallelism (the router statistics of the load-balancing loss summed over the CP ranks):
    # Mixtral's window with its blocks recomputed over two stages and its experts split over the 2 CP ranks (EP=2);
    # Qwen3-MoE's experts split over TP=2 with sequence parallelism (the row in C x T = 4 pieces) and the chunked
    # vocab-parallel loss.
    "mixtral-pp2-cp2-ep2-recompute": ("mixtral", "true", 2, 1, "", 0),
    "qwen3_moe-tp2-cp2-chunked": ("qwen3_moe", "false", 1, 2, "", 5),
    # Llama 4 under CP=2: chunked attention across the shard boundary, the NoPE layer's temperature counted from the
    # row's start on the second shard.
    "llama4-pp2-cp2": ("llama4", "false", 2, 1, "", 0),
    # Families of one registry module each: Gemma 3's four norms, scaled embeddings and soft-capped logits under TP=2
    # with SP and the vocab-parallel loss (tied embeddings); SmolLM3's NoPE layers on both stages; Helium's o_proj
    # (hidden x hidden) split by heads; Ministral 3's position-scaled queries under its window; Seed-OSS's own o_proj
    # bias under TP; ERNIE 4.5's interleaved RoPE with every bias and tied embeddings.
    "gemma3-pp2-tp2": ("gemma3", "false", 2, 2, "", 0),
    "smollm3-pp2-dp2": ("smollm3", "false", 2, 1, "", 0),
    "helium-pp2-tp2": ("helium", "false", 2, 2, "", 0),
    "ministral3-pp2-dp2": ("ministral3", "false", 2, 1, "", 0),
    "seed_oss-pp2-tp2": ("seed_oss", "false", 2, 2, "", 0),
    "ernie4_5-pp2-dp2": ("ernie4_5", "false", 2, 1, "", 0),
    # Fused q/k/v and gate/up (Phi-3, its window), four norms and fused gate/up (GLM-4), norms after each sublayer with
    # q/k norms over the whole projection (their statistics summed over TP) and local layers (OLMo 3, OLMo 2).
    "phi3-pp2-dp2": ("phi3", "false", 2, 1, "", 0),
    "phi3-pp2-tp2": ("phi3", "false", 2, 2, "", 0),
    "glm4-pp2-dp2": ("glm4", "false", 2, 1, "", 0),
    "glm4-pp2-tp2": ("glm4", "false", 2, 2, "", 0),
    "olmo3-pp2-dp2": ("olmo3", "false", 2, 1, "", 0),
    "olmo2-pp2-tp2": ("olmo2", "false", 2, 2, "", 0),
    # Each of those families at the other 4-rank layout too: PP=2 x DP=2 where the one above is PP=2 x TP=2 and the
    # other way round (SmolLM3's NoPE layers, Ministral 3's scaled queries, ERNIE 4.5's interleaved RoPE and OLMo 3's
    # local layers split by heads).
    "gemma3-pp2-dp2": ("gemma3", "false", 2, 1, "", 0),
    "helium-pp2-dp2": ("helium", "false", 2, 1, "", 0),
    "seed_oss-pp2-dp2": ("seed_oss", "false", 2, 1, "", 0),
    "olmo2-pp2-dp2": ("olmo2", "false", 2, 1, "", 0),
    "smollm3-pp2-tp2": ("smollm3", "false", 2, 2, "", 0),
    "ministral3-pp2-tp2": ("ministral3", "false", 2, 2, "", 0),
    "ernie4_5-pp2-tp2": ("ernie4_5", "false", 2, 2, "", 0),
    "olmo3-pp2-tp2": ("olmo3", "false", 2, 2, "", 0),
    # DeepSeek's router, dense first layers, shared experts: DeepSeek-V3's MLA split by heads over TP=2, its experts
    # over EP=2 across two stages, both with its score biases balanced after every step; GLM-4.5's experts over
    # TP=2 x EP=2 with sequence parallelism, and over EP=2 across two stages with its score biases balanced.
    "deepseek_v3-pp2-tp2-balanced": ("deepseek_v3", "false", 2, 2, "", 0),
    "deepseek_v3-pp2-dp2-ep2-balanced": ("deepseek_v3", "false", 2, 1, "", 0),
    "glm4_moe-tp2-dp2-ep2": ("glm4_moe", "false", 1, 2, "", 0),
    "glm4_moe-pp2-dp2-ep2-balanced": ("glm4_moe", "false", 2, 1, "", 0),
    # Mistral 4: DeepSeek-V3's MLA with position-scaled queries and a softmax router; its experts (fused on the hub)
    # split over EP=2 across two stages.
    "mistral4-pp2-dp2-ep2": ("mistral4", "false", 2, 1, "", 0),
    # gpt-oss (eager: its attention sinks), its experts with biases split over EP=2 across two stages, its
    # load-balancing loss on.
    "gpt_oss-pp2-dp2-ep2": ("gpt_oss", "false", 2, 1, "", 0),
    # ... and over TP=2 x EP=2 with sequence parallelism: each expert's interleaved gate/up and down split over TP,
    # its down bias whole on both TP ranks and counted once in the norm.
    "gpt_oss-tp2-dp2-ep2": ("gpt_oss", "false", 1, 2, "", 0),
    # Qwen3-Next: Gated DeltaNet linear attention on both stages, gated full attention, a gated shared expert, its
    # experts split over EP=2, every block recomputed.
    "qwen3_next-pp2-dp2-ep2-recompute": ("qwen3_next", "true", 2, 1, "", 0),
    "qwen3_5-pp2-dp2": ("qwen3_5", "false", 2, 1, "", 0),
    # Qwen3.5-MoE: the hybrid with a sparse block and a gated shared expert in every layer, its experts (fused on the
    # hub) split over EP=2 across two stages, its load-balancing loss on.
    "qwen3_5_moe-pp2-dp2-ep2": ("qwen3_5_moe", "false", 2, 1, "", 0),
    # ... and over TP=2 x EP=2 with sequence parallelism: its linear attention split by heads, its experts over TP
    # (rows) and EP at once, the shared expert and its gate over TP.
    "qwen3_5_moe-tp2-dp2-ep2": ("qwen3_5_moe", "false", 1, 2, "", 0),
    # DeepSeek-V3.2: DeepSeek-V3's MLA split by heads over TP=2 with its (frozen, replicated) indexer choosing each
    # query's keys, its experts over EP=2.
    "deepseek_v32-tp2-dp2-ep2": ("deepseek_v32", "false", 1, 2, "", 0),
    # Qwen3.5's linear attention split by heads (q/k/v in one projection and the convolution part by part) and its
    # gated full attention, over two stages.
    "qwen3_5-pp2-tp2": ("qwen3_5", "false", 2, 2, "", 0),
    # Gemma 4: its per-layer inputs and the local layers' shared K/V carried across the cut (the global layers' K/V
    # made and read on the second stage), their gradients back to their makers; under TP=2 with sequence parallelism
    # each rank carries its own K/V heads and its positions of the per-layer inputs.
    "gemma4-pp2-dp2": ("gemma4", "false", 2, 1, "", 0),
    "gemma4-pp2-tp2": ("gemma4", "false", 2, 2, "", 0),
    # GLM-5: block 1's sparse-attention index carried to blocks 2 and 3 on the second stage, its experts over EP=2;
    # under TP=2 with SP its (frozen, replicated) indexers choose the same keys on both ranks.
    "glm_moe_dsa-pp2-dp2-ep2": ("glm_moe_dsa", "false", 2, 1, "", 0),
    "glm_moe_dsa-pp2-tp2": ("glm_moe_dsa", "false", 2, 2, "", 0),
    # Gemma 4's MoE block (26B-A4B: experts beside the dense MLP): its experts over EP=2 across two stages, and over
    # TP=2 with SP (the router's input entered outside any split region, the experts' output summed before its norm).
    "gemma4_moe-pp2-dp2-ep2": ("gemma4_moe", "false", 2, 1, "", 0),
    "gemma4_moe-pp2-tp2": ("gemma4_moe", "false", 2, 2, "", 0),
    # DeepSeek-V4: its 3 residual streams and the tokens to hash layer 3 across the cut, its experts over EP=2, the
    # top-k routers' score biases balanced after every step (the hash routers' choice is their table).
    "deepseek_v4-pp2-dp2-ep2-balanced": ("deepseek_v4", "false", 2, 1, "", 0),
    # ... and over TP=2 as transformers' plan splits it: its attention and hyper-connections whole on both ranks, its
    # experts and shared expert split; under sequence parallelism the attention gathers the row and keeps its positions.
    "deepseek_v4-pp2-tp2": ("deepseek_v4", "false", 2, 2, "", 0),
    # One module each: Granite's embedding and logit multipliers through the vocab-parallel head and loss (PP=2 x
    # TP=2), EXAONE 4's post-sublayer norms and per-head q/k norms split by heads with its local and NoPE layers.
    "granite-pp2-tp2": ("granite", "false", 2, 2, "", 0),
    "exaone4-pp2-tp2": ("exaone4", "false", 2, 2, "", 0),
    # OLMoE's experts over EP=2 with its load-balancing loss; dots.llm1's DeepSeek router under TP=2 x EP=2.
    "olmoe-pp2-dp2-ep2": ("olmoe", "false", 2, 1, "", 0),
    "dots1-tp2-dp2-ep2": ("dots1", "false", 1, 2, "", 0),
    # FlexOlmo: OLMo 2's layer with its experts over EP=2 (its TP block is held to the whole block's gradients in
    # tests/test_tensor_parallel.py; trained at PP=2 x TP=2 one expert element moved 1.1-2.4% of lr between runs).
    "flex_olmo-pp2-dp2-ep2": ("flex_olmo", "false", 2, 1, "", 0),
    # MiniMax-M2: whole-projection q/k norms split by heads, its experts over EP=2 routed by the block's score bias.
    "minimax_m2-tp2-dp2-ep2": ("minimax_m2", "false", 1, 2, "", 0),
    # GLM-4.7-Flash: MLA split by heads, dense and sparse layers by type, its experts over EP=2 across two stages.
    "glm4_moe_lite-pp2-dp2-ep2": ("glm4_moe_lite", "false", 2, 1, "", 0),
    # Apertus: per-head q/k norms and the xIELU scalars (their gradients summed over TP) at PP=2 x TP=2.
    "apertus-pp2-tp2": ("apertus", "false", 2, 2, "", 0),
    # K-EXAONE: its score biases (renamed on the hub) balanced, its experts over EP=2 across two stages.
    "exaone_moe-pp2-dp2-ep2-balanced": ("exaone_moe", "false", 2, 1, "", 0),
    # Hunyuan MoE (TP refused): its fp32 router and shared MLP, its experts over EP=2 across two stages.
    "hunyuan_moe-pp2-dp2-ep2": ("hunyuan_moe", "false", 2, 1, "", 0),
    # MiMo-V2-Flash: sinks split with the heads, each layer's key/value heads by its own count, at TP=2 x EP=2.
    "mimo_v2_flash-tp2-dp2-ep2": ("mimo_v2_flash", "false", 1, 2, "", 0),
    # ERNIE 4.5 MoE: a dense and a sparse layer on each stage, its experts over EP=2, the load-balancing loss on.
    "ernie_moe-pp2-dp2-ep2": ("ernie_moe", "false", 2, 1, "", 0),
    # Cohere 2: its parallel block under TP with SP, logits times logit_scale through the vocab-parallel head.
    "cohere2-pp2-tp2": ("cohere2", "false", 2, 2, "", 0),
    # LFM2: a short convolution (by channels) and an attention layer (by heads) on each stage, under TP=2 with SP.
    "lfm2-pp2-tp2": ("lfm2", "false", 2, 2, "", 0),
    "lfm2_moe-tp2-dp2-ep2": ("lfm2_moe", "false", 1, 2, "", 0),  # its experts over TP=2 and EP=2 at once
    # Granite 4: a Mamba-2 and an attention layer on each stage, its experts over EP=2, its load-balancing loss on.
    "granite4-pp2-dp2-ep2": ("granite4", "false", 2, 1, "", 0),
    # Falcon-H1: Mamba-2 and attention side by side in every layer, its multipliers, every block recomputed.
    "falcon_h1-pp2-dp2-recompute": ("falcon_h1", "true", 2, 1, "", 0),
    # Nemotron-H: every kind of block on each stage, its gateless experts over EP=2 routed by their score biases.
    "nemotron_h-pp2-dp2-ep2": ("nemotron_h", "false", 2, 1, "", 0),
    # Kimi Linear: a Kimi Delta Attention and a latent attention layer on each stage, its experts over EP=2.
    "kimi_linear-pp2-dp2-ep2": ("kimi_linear", "false", 2, 1, "", 0),
}
