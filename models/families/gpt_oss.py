"""gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): attention with a learned sink per head (a logit every query
attends beside the keys, dropped after the softmax: transformers computes it in its eager attention only, so the
family runs eager unless told otherwise, and SDPA is refused), sliding and full layers alternating, q/k/v/o biases;
every layer sparse, its experts fused as transformers keeps them on the hub (x @ W: `gate_up_proj` [E, H, 2I] with
gate and up columns interleaved, `down_proj` [E, I, H], each with a bias per expert), a router with a bias (top-k of
the logits, then a softmax over those k), the clamped SwiGLU, transformers' load-balancing loss. The official
checkpoints keep the experts in MXFP4 (`*_blocks`, `*_scales`): conversion dequantizes them
(checkpoint/dequantize.py). Under tensor parallelism the sinks split with the heads, each expert's interleaved gate/up
columns in contiguous blocks (pairs whole), and each expert's down bias is added on one rank only
(models/tensor_parallel.py `split_sparse_block`)."""

from models.families import Family, MoeSpec, register

register(
    Family(
        "gpt_oss",
        "GptOss",
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        moe=MoeSpec(
            "mlp",
            ("gate_proj", "up_proj", "down_proj"),
            "num_local_experts",
            "intermediate_size",
            every_layer=True,
            router="router",
            hub_fused=True,
            interleaved_gate_up=True,
        ),
        per_head=("self_attn.sinks",),
        flash_refused="its attention sinks need flash-attn kernels that take them (s_aux), not the flash-attn package",
        # 4 experts, top-2; sliding (window 4) and full layers alternating.
        tiny=dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=4),
    )
)
