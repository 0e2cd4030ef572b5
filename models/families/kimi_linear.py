"""Kimi Linear (`kimi_linear`: Kimi-Linear-48B-A3B): Kimi Delta Attention ("linear_attention" layers: Gated DeltaNet
with a decay per channel, `forget_gate`, q/k/v through short convolutions, a gated output norm; transformers' torch
path on CPU, the fla kernels where installed) beside multi-head latent attention without RoPE ("full_attention"),
as `layer_types` says; DeepSeek's sparse blocks (sigmoid router with a score bias and groups, shared experts) in the
layers `mlp_layer_types` lists as sparse, a dense MLP in the others. On the hub the short convolutions are three
tensors (`q_conv1d`, `k_conv1d`, `v_conv1d`, concatenated by transformers into `conv1d`: models/key_table.py
`hub_parts`), the decay's parameters sit on the attention (renamed onto `forget_gate` as transformers renames
them), and the sparse block is `block_sparse_moe` with Mixtral's expert names (`w1`, `w3`, `w2`, one key per
expert). The recurrence runs along the whole row: packed rows and context parallelism are refused in one line.
Tensor parallelism is refused until Kimi Delta Attention's split is built."""

from dataclasses import replace

from models.families import Family, register
from models.families.deepseek_v3 import DEEPSEEK_MOE

register(
    Family(
        "kimi_linear",
        "KimiLinear",
        hub_renames=True,
        moe=replace(
            DEEPSEEK_MOE,
            hub_block="block_sparse_moe",
            expert_names=("w1", "w3", "w2"),
            num_experts="num_experts",
            first_dense="",
            layer_types="mlp_layer_types",
        ),
        tp_refused="its Kimi Delta Attention's heads and short convolutions are not in the split rules yet",
        # Kimi Delta Attention in layers 0 and 2, latent attention in 1 and 3 (each kind on each of two stages); a
        # dense first layer, then sparse blocks of 4 experts (top-2 of 2 groups, scaled by 2.5) with a shared expert.
        tiny=dict(
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            linear_num_heads=4,
            linear_head_dim=16,
            linear_conv_kernel_dim=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            pad_token_id=0,
        ),
    )
)
