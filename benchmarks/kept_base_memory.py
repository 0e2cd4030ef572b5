"""What a stage holds of a LoRA run's frozen base when the hub's quantized weights are kept as they are
(`lora.keep_quantized=true`), against the base dequantized to bf16 (docs/lora_and_preference.md), by the planner.

    python -m benchmarks.kept_base_memory

DeepSeek-V3 (its preset; FP8 in 128 x 128 blocks, as deepseek-ai/DeepSeek-V3's config.json says) and Kimi K2
Thinking (the kimi_k2 preset; its routed experts INT4, as moonshotai/Kimi-K2-Thinking's says) at PP=16 x EP=8 on
128 GPUs, and gpt-oss-120b (MXFP4 experts, its attention and router plain, as openai/gpt-oss-120b's says) at PP=4 x
EP=2 on 8: 4,096-token rows, LoRA, every block recomputed. Per model, the busiest stage and a middle one: its weights
dequantized and kept, and the one layer's local experts a forward dequantizes (counted in the kept figure). The
planner's count is held to what a held model holds, to the byte (tests/test_kept_quantized.py).

    python -m benchmarks.kept_base_memory --host

Measured on this machine: the host memory `hold_hub_weights` takes while it reads and holds a stage, on a synthetic
FP8 hub (Llama-shaped, hidden 1,024, 8 layers, 16 x 16 blocks: 138 MB of quantized tensors): resident set sampled
every 2 ms, its growth over the resident set before, medians of 3 runs in fresh processes.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile

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


HOLD = """
import sys, threading, time, torch
from transformers import AutoConfig, AutoModelForCausalLM
from checkpoint.kept_quantized import hold_hub_weights
c = AutoConfig.from_pretrained(sys.argv[1] + "/plain")
m = AutoModelForCausalLM.from_config(c, dtype=torch.bfloat16)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
peak, done = [0], [False]
def sample():
    while not done[0]:
        peak[0] = max(peak[0], rss()); time.sleep(0.002)
start = rss(); t = threading.Thread(target=sample); t.start()
hold_hub_weights(m, sys.argv[1] + "/fp8", c)
done[0] = True; t.join()
print(peak[0] - start)
"""


def host() -> None:
    import os

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tools.quantized_hubs import quantize_fp8

    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.for_model(
            "llama", vocab_size=1000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(f"{tmp}/plain", max_shard_size="200MB")
        quantize_fp8(f"{tmp}/plain", f"{tmp}/fp8")
        stored = sum(os.path.getsize(f"{tmp}/fp8/{n}") for n in os.listdir(f"{tmp}/fp8") if n.endswith(".safetensors"))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
        hold = [sys.executable, "-c", HOLD, tmp]
        runs = [int(subprocess.check_output(hold, env=env, text=True).split()[-1]) for _ in range(3)]
        growth = statistics.median(runs) / 2**20
        print(f"holding a stage of {stored / 2**20:.0f} MiB on disk: host memory grows {growth:.0f} MiB (median of 3)")


if __name__ == "__main__":
    host() if "--host" in sys.argv else main()
