"""bf16 parity of the trainer against transformers on one GPU (../shared/GPU.md, step 2), on a random model.

    python -m benchmarks.gpu_parity --work /tmp/gpu --out parity.json [--layers 16 --hidden 2048 ...]
        [--model-type deepseek_v3 --config '{"n_routed_experts": 16, ...}']

1. Logits: the pipeline's layers (models/layers.py, one process) against transformers' model, both bf16 with SDPA on
   the same micro-batch: the largest logit difference, how many logits differ, and the two losses.
2. Training: `trainer.py` (DeepSpeed launcher, one rank, PP=1, `deepspeed=bf16_zero1`) against the plain loop
   (benchmarks/plain_loop.py: transformers + torch AdamW with fp32 master weights and fp32 gradient accumulation,
   what DeepSpeed's bf16 optimizer does) for `--steps` steps on the same batches; the same plain loop in fp32 is the
   yardstick: bf16's own distance from fp32 next to the trainer's distance from the plain bf16 loop. With
   `--fp32-trainer` the trainer also runs in fp32 against the plain fp32 loop.

Run on a CPU with small shapes (`--device cpu --precision fp32`) it checks the script itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys

from benchmarks.train_throughput import add_family_arguments

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pipeline_logits(hf: str, ids, pos, device: str, dtype):
    """Logits of the pipeline's layers, built in one process from `hf`'s files, on `device` in `dtype`."""
    import torch
    from safetensors.torch import load_file

    from models.config import load_hf_config
    from models.families import resolve_attention
    from models.head import split_stats, tied_lm_head_forward
    from models.key_table import all_layer_keys
    from models.layers import DecoderOptions, build_layer
    from models.pipe_layout import pipe_layers

    config = load_hf_config(hf)
    config._attn_implementation = resolve_attention(config, None)  # SDPA; eager for gpt-oss's sinks
    state = {}
    for path in sorted(glob.glob(os.path.join(hf, "*.safetensors"))):
        state.update(load_file(path))
    keys = all_layer_keys(config)
    modules = []
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if layer.has_file:
            module = build_layer(layer, config, DecoderOptions())
            module.load_state_dict({ours: state.pop(key) for ours, key in keys[layer.index].items()})
            modules.append(module.to(device=device, dtype=dtype).eval())
    x = (ids, pos)
    with torch.no_grad():
        for module in modules:
            x = module(x)
        x = tied_lm_head_forward(modules[0], x) if config.tie_word_embeddings else x
        return split_stats(x)[0]


def logits_parity(hf: str, data: str, args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.plain_loop import plain_attention, plain_batches
    from models.loss import summed_cross_entropy

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    (ids, pos), labels, _ = next(plain_batches(hf, data, args.seq, args.mbs, 1, False))
    ids, pos, labels = ids.to(args.device), pos.to(args.device), labels.to(args.device)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=dtype, attn_implementation=plain_attention(hf))
    model = model.to(args.device).eval()
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=pos).logits
    del model
    ours = pipeline_logits(hf, ids, pos, args.device, dtype)
    tokens = int((labels != -100).sum())
    diff = (ours.float() - reference.float()).abs()
    return {
        "logits": reference.numel(),
        "logits_differing": int((diff > 0).sum()),
        "max_abs_logit_diff": float(diff.max()),
        "max_abs_logit": float(reference.float().abs().max()),
        "loss_ours": float(summed_cross_entropy(ours, labels)) / tokens,
        "loss_transformers": float(summed_cross_entropy(reference, labels)) / tokens,
    }


def compare(a: list[float], b: list[float]) -> dict:
    """The largest absolute and relative differences between two per-step series."""
    pairs = list(zip(a, b, strict=True))
    return {
        "max_abs": max(abs(x - y) for x, y in pairs),
        "max_rel": max(abs(x - y) / max(abs(y), 1e-12) for x, y in pairs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--out", required=True, help="the figures, as JSON")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--ga", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--fp32-trainer", action="store_true", help="also the trainer in fp32 against the plain fp32 loop")
    p.add_argument("--threads", type=int, default=4)
    add_family_arguments(p)
    args = p.parse_args()
    sys.path.insert(0, REPO)
    import torch

    from benchmarks.plain_loop import plain_run
    from benchmarks.train_throughput import build, trainer_run

    args.packing = False
    shape = dict(num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate, vocab_size=args.vocab)
    shape["max_position_embeddings"] = max(args.seq, 4096)  # one model for this and the 4k throughput run
    shape |= json.loads(args.config)
    hf, data = build(args.work, args.layers, args.hidden, args.heads, args.rows, model_type=args.model_type, **shape)
    result = {"shape": vars(args) | {"packing": False}, "logits": logits_parity(hf, data, args)}
    print("logits:", json.dumps(result["logits"]), flush=True)

    def trainer(precision: str) -> dict:
        args.precision = precision
        out = os.path.join(args.work, f"trainer_{precision}")
        metrics = trainer_run(hf, data, out, 1, args, args.ga)
        shutil.rmtree(out, ignore_errors=True)  # its final checkpoint: ~16 bytes a parameter
        return {"losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics]}

    def plain(precision: str) -> dict:
        fields = dict(seq=args.seq, mbs=args.mbs, ga=args.ga, steps=args.steps, device=args.device)
        run = plain_run(hf, data, **fields, precision=precision, threads=args.threads)
        return {"losses": run.losses, "grad_norms": run.grad_norms}

    low = args.precision
    runs = result["runs"] = {}
    todo = [(f"trainer_{low}", trainer, low), (f"plain_{low}", plain, low)]
    todo += [("plain_fp32", plain, "fp32")] if low != "fp32" else []
    todo += [("trainer_fp32", trainer, "fp32")] if args.fp32_trainer and low != "fp32" else []
    for name, run, precision in todo:
        torch.cuda.empty_cache()  # what this process cached goes back before the trainer's process starts
        runs[name] = run(precision)
        with open(args.out, "w") as f:  # as it goes: a GPU lent for minutes may be taken back mid-way
            json.dump(result, f, indent=1)
    gaps = {
        f"trainer_{low} vs plain_{low}": (f"trainer_{low}", f"plain_{low}"),
        f"plain_{low} vs plain_fp32": (f"plain_{low}", "plain_fp32"),
        "trainer_fp32 vs plain_fp32": ("trainer_fp32", "plain_fp32"),
    }
    result["gaps"] = {}
    for name, (a, b) in gaps.items():
        if a in runs and b in runs and a != b:
            result["gaps"][name] = {
                "loss": compare(runs[a]["losses"], runs[b]["losses"]),
                "grad_norm": compare(runs[a]["grad_norms"], runs[b]["grad_norms"]),
            }
            print(f"{name}: {json.dumps(result['gaps'][name])}", flush=True)
    for name, run in runs.items():
        print(f"{name} losses: {[round(x, 5) for x in run['losses']]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
