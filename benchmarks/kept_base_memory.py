"""What a stage holds of a LoRA run's frozen base when the hub's quantized weights are kept as they are
(`lora.keep_quantized=true`), against the base dequantized to bf16 (docs/lora_and_preference.md), by the planner.

    python -m benchmarks.kept_base_memory

DeepSeek-V3 (its preset; FP8 in 128 x 128 blocks, as deepseek-ai/DeepSeek-V3's config.json says) and Kimi K2
Thinking (the kimi_k2 preset; its routed experts INT4, as moonshotai/Kimi-K2-Thinking's says) at PP=16 x EP=8 on
128 GPUs, and gpt-oss-120b (MXFP4 experts, its attention and router plain, as openai/gpt-oss-120b's says) at PP=4 x
EP=2 on 8: 4,096-token rows, LoRA, every block recomputed. Per model, the busiest stage and a middle one: its weights
dequantized and kept, and the one layer's local experts a forward dequantizes (counted in the kept figure). The
planner's count is held to what a held model holds, to the byte (tests/test_kept_quantized.py).
"""

from __future__ import annotations

from schema.compose import compose_config
from tools.memory_model import GIB, estimate, for_gpu, kept_layer_counts
from training.assembly import load_model_config

HUB = {  # each release's quantization_config, which the run reads from its hub directory
    "deepseek_v3": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "gpt_oss_120b": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    },
}
HUB["kimi_k2"] = {  # Kimi K2 Thinking's: its routed experts INT4 in groups of 32 (bf16 scales), the rest plain
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|down)_proj.*"],
}
LAYOUTS = {"deepseek_v3": (16, 8, 128), "kimi_k2": (16, 8, 128), "gpt_oss_120b": (4, 2, 8)}  # PP, EP, GPUs


def main() -> None:
    for model, (pp, ep, gpus) in LAYOUTS.items():
        rows = {}
        for kept in (False, True):
            cfg = for_gpu(
                compose_config(
                    [
                        f"model={model}",
                        f"num_stages={pp}",
                        f"expert_parallel_size={ep}",
                        "seq_length=4096",
                        "lora.enabled=true",
                        f"lora.keep_quantized={str(kept).lower()}",
                        "model.activation_checkpointing=true",
                    ]
                )
            )
            config = load_model_config(cfg)
            config.quantization_config = HUB[model]
            rows[kept] = estimate(cfg, config, gpus)
        dense_experts = max(c[2] for c in kept_layer_counts(config, ep, config)) * 2 / GIB
        print(
            f"{model}, PP={pp} x EP={ep} on {gpus} GPUs; one layer's local experts dequantized: {dense_experts:.2f} GiB"
        )
        busiest = max(range(pp), key=lambda i: rows[False][i].weights)
        for stage in (busiest, pp // 2):
            a, b = rows[False][stage], rows[True][stage]
            print(
                f"  stage {stage}: weights {a.weights / GIB:.1f} GiB dequantized, {b.weights / GIB:.1f} GiB kept "
                f"({b.weights / a.weights:.2f}x); the stage {a.total / GIB:.1f} -> {b.total / GIB:.1f} GiB"
            )


if __name__ == "__main__":
    main()
