"""Granite 4 (`granitemoehybrid`: Granite-4.0-H-Micro, H-Tiny, H-Small): Mamba-2 layers (`mamba`: in_proj makes the
gate, x, B, C and dt; a causal depthwise convolution over x, B and C; the chunked selective scan per head with `A_log`,
`dt_bias` and the `D` skip; a gated RMSNorm by groups; out_proj; transformers' pure torch path on CPU, mamba_ssm and
causal-conv1d where installed) beside attention layers, as `layer_types` says ("linear_attention" or
"full_attention"); attention without RoPE unless `position_embedding_type` is "rope" (the H models' is "nope"); in
every layer a dense `shared_mlp` (gate and up in one `input_linear`) and, where `num_local_experts` > 0, a sparse
block beside it (`block_sparse_moe`: a softmax over the top-k logits, experts fused on the hub as in memory under the
names transformers renames, `input_linear`, `output_linear`, `router.layer`), its load-balancing loss; Granite's muP
multipliers (embedding, residual, attention, logits). The Mamba state runs along the whole row: packed rows and
context parallelism are refused in one line, as for linear attention. Tensor parallelism is refused until its split
(Mamba's heads with the convolution's channels and the gated norm's groups; the fused shared MLP) is built."""

from models.families import Family, MoeSpec, register

register(
    Family(
        "granitemoehybrid",
        "GraniteMoeHybrid",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        embedding_multiplier="embedding_multiplier",
        logits_divisor="logits_scaling",
        mlp="shared_mlp",
        moe=MoeSpec(
            "block_sparse_moe",
            ("gate_proj", "up_proj", "down_proj"),  # (unused: the hub keeps them fused)
            "num_local_experts",
            "intermediate_size",
            every_layer=True,
            block="block_sparse_moe",
            router="router",
            hub_fused=True,
        ),
        moe_when="num_local_experts",
        hub_renames=True,
        tp_refused="its Mamba-2 layers' heads, convolution channels and norm groups are not in the split rules yet",
        # Mamba-2 in layers 0 and 2, attention in 1 and 3 (each kind on each of two stages): 8 heads of 16 over 2
        # groups, chunks of 8 (so a 12-token row spans two); 4 experts (top-2) beside the shared MLP; Granite-4.0-H's
        # multipliers (each one shows at this size).
        tiny=dict(
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_proj_bias=True,
            position_embedding_type="nope",
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            shared_intermediate_size=64,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.0078125,
            logits_scaling=16.0,
        ),
    )
)
