"""Nemotron-H (`nemotron_h`: NVIDIA Nemotron 3 Nano 30B-A3B, Nemotron-H 4B-56B, Nemotron Nano 2): one token mixer or
MLP per block (`mixer`, after the block's one `norm`), as `layers_block_type` says: Mamba-2 ("linear_attention": the
same mixer as Granite 4's and Falcon-H1's), attention without RoPE ("full_attention"), a dense MLP ("mlp": up and
down, squared ReLU) or a sparse block ("moe": DeepSeek's sigmoid router with a score bias and groups, gateless
squared-ReLU experts kept one key each on the hub, a shared expert; no load-balancing loss). The embedding is
`model.embeddings`, the final norm `model.norm_f`, and the hub keeps the model under `backbone.` (transformers
renames it). Mamba's state runs along the whole row: packed rows and context parallelism are refused in one line.
Tensor parallelism is refused until Mamba's split is built."""

from dataclasses import replace

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE

MAMBA = "Mamba-2 blocks carry a state along the whole row"

register(
    Family(
        "nemotron_h",
        "NemotronH",
        class_names={"DecoderLayer": "Block"},
        norms=("norm",),
        tp_entry_norms=("norm",),
        mlp_bias="mlp_bias",
        attention="mixer",
        embedding="embeddings",
        final_norm="norm_f",
        hub_renames=True,
        # DeepSeek's sparse block (router, score bias, shared expert) with gateless experts, in the "moe" blocks
        moe=replace(
            DEEPSEEK_MOE,
            hub_block="mixer",
            expert_names=("", "up_proj", "down_proj"),
            first_dense="",
            layer_types="layers_block_type",
            block="mixer",
        ),
        packing_refused=MAMBA,
        cp_refused=MAMBA,
        tp_refused="its Mamba-2 mixers' heads, convolution channels and norm groups are not in the split rules yet",
        # Each kind of block on each of two stages: Mamba-2 (8 heads of 16 over 2 groups, chunks of 8, so a 12-token
        # row spans two), a sparse block (4 gateless experts, top-2 of 2 groups, scaled by 2.5, a shared expert),
        # attention (2 K/V heads) and a dense MLP; every bias the config allows.
        tiny=dict(
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"] * 2,
            num_key_value_heads=2,
            head_dim=16,
            mamba_num_heads=8,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            chunk_size=8,
            mamba_proj_bias=True,
            use_conv_bias=True,
            mlp_bias=True,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            layer_norm_epsilon=1e-5,
        ),
    )
)
