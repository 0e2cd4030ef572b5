"""Training throughput of the trainer against a plain PyTorch loop on the same model, rows and batch.

    python -m benchmarks.train_throughput --work /tmp/trainbench [--stages 1,2] [--packing] [--peak-tflops X]
    python -m benchmarks.train_throughput --work /tmp/trainbench --stages 1,2 --ga 2,4,8 \
        --schedule 1f1b,zero_bubble,dualpipev --skip-plain

Builds (once) a random LLaMA (`--layers`, `--hidden`; another family with `--model-type` and `--config`, a JSON
object of its config's fields) with a tokenizer and variable-length rows, then:

- runs `trainer.py` through the DeepSpeed launcher for each number of stages (`--stages`, one rank
  each, DP=1) and reads `metrics.jsonl`: median step time after `--warmup` steps, tokens/s (tokens
  that are not padding) and padded tokens/s, per device too;
- runs a plain loop (transformers' `AutoModelForCausalLM` + `torch.optim.AdamW`, no DeepSpeed) on the same
  global batches (the trainer's own sampler and collator) in the same precision (fp32 on CPU);
- prints the trainer/plain step-time ratio (PP=1: the pipeline engine's overhead), achieved model
  FLOP/s by PaLM's convention (6N + 12*L*H*Q*T FLOPs per token, N = parameters outside the input
  embedding, those a token uses in a mixture of experts, L layers, H heads, Q head size, T sequence length) and MFU
  when `--peak-tflops` is given,
  and the theoretical pipeline bubble (p-1)/(m+p-1) next to the measured step-time growth over PP=1.

With `--schedule` (comma-separated `pipeline_schedule` values) and `--ga` (comma-separated micro-batch counts),
every PP > 1 runs each schedule on the same batches: its step time against 1F1B's, its measured bubble
1 - T(PP=1) / (p x T(PP=p)) (the share of the p ranks' time not spent on the PP=1 work), and beside them the
theory: the bubble and step-time ratio of `training.schedules.timeline` (the instruction lists the engines
execute, costs F=1, B=2, W=1). DualPipeV needs m >= 2p and is skipped below that.

Each configuration runs `--repeat` times; medians are reported. Not a test: timings on a shared machine
are noisy, compare figures from one run of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(
    work: str, layers: int, hidden: int, heads: int, rows: int, seed: int = 0, model_type: str = "llama", **config
) -> tuple[str, str]:
    """(model dir, data file) under `work`, built once: a random model of `model_type` (`config`: more fields)."""
    from data.sources import write_jsonl
    from tools.tiny_models import make_hf_model, make_sp_tokenizer, tiny_config

    hf, data = os.path.join(work, "hf"), os.path.join(work, "train.jsonl")
    if not os.path.exists(os.path.join(hf, "config.json")):
        rng = random.Random(seed)
        words = "the quick brown fox jumps over a lazy dog while pipelines train language models fast".split()
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 120))) for _ in range(rows)]
        tokenizer = make_sp_tokenizer(os.path.join(work, "tokenizer"), texts[:200], vocab_size=200)
        fields = dict(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=hidden * 8 // 3,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=256,
        )
        config = tiny_config(model_type, **fields | config)
        make_hf_model(hf, config, tokenizer_dir=tokenizer, max_shard_size="2GB")
        write_jsonl(data, [{"text": t} for t in texts])
    return hf, data


def trainer_overrides(hf: str, data: str, out: str, stages: int, args, ga: int, schedule: str, extra=()) -> list[str]:
    return [
        f"model_name_or_path={hf}",
        f"output_dir={out}",
        f"train_file={data}",
        "do_eval=false",
        f"num_stages={stages}",
        f"seq_length={args.seq}",
        f"micro_batch_size={args.mbs}",
        f"gradient_accumulation_steps={ga}",
        f"max_steps={args.steps}",
        f"deepspeed={'bf16_zero1' if getattr(args, 'precision', 'fp32') == 'bf16' else 'fp32'}",
        "progress_bar=false",
        "save_steps=0",
        "save_manifest=false",
        f"data.packing={str(args.packing).lower()}",
        "optim.lr_scheduler=constant",
        "learning_rate=1e-4",  # the plain loop's
        f"pipeline_schedule={schedule}",
        *extra,
    ]


def trainer_run(
    hf: str, data: str, out: str, stages: int, args, ga: int, schedule: str = "1f1b", ranks: int = 0, extra=()
) -> list[dict]:
    """metrics.jsonl of one trainer launch on `ranks` processes (default `stages`), with more `extra` overrides."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (the trainer refuses to mix runs)
    overrides = trainer_overrides(hf, data, out, stages, args, ga, schedule, extra)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=path)
    cmd = [*launcher(), "--num_gpus", str(ranks or stages), "trainer.py", *overrides]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode:  # the launch's own words: on a machine lent for minutes there is no second look
        print((done.stdout + done.stderr)[-6000:], file=sys.stderr)
        raise SystemExit(f"trainer.py exited {done.returncode} ({' '.join(overrides)})")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def launcher() -> list[str]:
    """This environment's `deepspeed` launcher; its module where the package was installed without scripts."""
    script = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [script] if os.path.exists(script) else [sys.executable, "-m", "deepspeed.launcher.runner"]


def plain_run(hf: str, data: str, args, ga: int):
    """Step times and peak memory of transformers + AdamW on the trainer's own batches (benchmarks/plain_loop.py)."""
    from benchmarks.plain_loop import plain_run as run

    fields = dict(seq=args.seq, mbs=args.mbs, ga=ga, steps=args.steps, packing=args.packing)
    return run(
        hf, data, **fields, precision=args.precision, device=args.device, threads=args.threads, profile=args.profile
    )


def model_flops_per_token(config, seq: int) -> float:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12*L*H*Q*T, N without the input embedding; for a mixture of
    experts N counts the parameters a token uses (top-k of E), and for latent attention Q is the mean of the query's
    and value's head sizes. Sliding windows are not discounted (an upper bound where layers slide)."""
    from models.partition import layer_param_counts

    active = layer_param_counts(config, active=True)
    n = sum(active) - active[0]  # the LM head is a matmul, the input embedding (pipeline layer 0) a lookup
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    qk = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0) or head_dim
    v = getattr(config, "v_head_dim", None) or head_dim
    return 6 * n + 6 * config.num_hidden_layers * heads * (qk + v) * seq


def add_family_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-type", default="llama", help="a supported family (tools/tiny_models.py tiny_config)")
    p.add_argument("--config", default="{}", help="more config fields, a JSON object (e.g. experts and their sizes)")


def intermediate(args) -> dict:
    return {"intermediate_size": args.intermediate} if args.intermediate else {}


def planned_gib(hf: str, args, ga: int) -> float:
    """The memory planner's busiest-stage figure (tools/memory_estimate.py) for the PP=1 run of `args`."""
    from schema.compose import compose_config
    from tools.memory_estimate import GIB, estimate
    from training.assembly import load_model_config

    overrides = trainer_overrides(hf, "unused.jsonl", "unused", 1, args, ga, "1f1b")
    cfg = compose_config(overrides)
    return max(r.total for r in estimate(cfg, load_model_config(cfg), 1)) / GIB


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--ga", default="4", help="comma-separated micro-batch counts per step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", default="1", help="comma-separated pipeline stage counts (one rank each)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank and for the plain loop")
    p.add_argument("--packing", action="store_true")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak, for MFU")
    p.add_argument("--schedule", default="1f1b", help="comma-separated pipeline_schedule values for PP > 1")
    p.add_argument("--skip-plain", action="store_true", help="leave out the plain PyTorch loop")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: deepspeed=bf16_zero1")
    p.add_argument("--device", default="cpu", help="the plain loop's device (cuda on a GPU)")
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--intermediate", type=int, default=None, help="default: 8/3 x --hidden")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--profile", default=None, help="a file: the plain loop's last step's torch.profiler table")
    add_family_arguments(p)
    args = p.parse_args()
    sys.path.insert(0, REPO)
    os.makedirs(args.work, exist_ok=True)
    shape = {"num_key_value_heads": args.kv_heads or args.heads, "vocab_size": args.vocab}
    shape["max_position_embeddings"] = max(args.seq, 256)
    shape |= intermediate(args) | json.loads(args.config)
    hf, data = build(args.work, args.layers, args.hidden, args.heads, args.rows, model_type=args.model_type, **shape)
    import torch
    from transformers import AutoConfig

    from schema.train import min_micro_batches

    config = AutoConfig.from_pretrained(hf)
    flops = model_flops_per_token(config, args.seq)
    schedules = args.schedule.split(",")
    print(
        f"model: {args.model_type}, {args.layers} layers, hidden {args.hidden}, {args.config}, "
        f"seq {args.seq}, micro-batch {args.mbs}, {args.precision} on {args.device}, "
        f"packing={args.packing}, {args.threads} thread(s)/rank; medians of {args.repeat} runs"
    )
    for ga in [int(m) for m in args.ga.split(",")]:
        t_plain = None
        if not args.skip_plain:
            try:
                runs = [plain_run(hf, data, args, ga) for _ in range(args.repeat)]
            except torch.OutOfMemoryError:  # transformers' loop holds the whole fp32 logits: the trainer may fit
                print(f"m={ga}: plain loop (transformers + AdamW, {args.precision}): out of memory", flush=True)
                runs = []
            if runs:
                plain = [statistics.median(r.seconds[args.warmup :]) for r in runs]
                t_plain = statistics.median(plain)
                memory = f", peak GPU memory {runs[0].max_memory_gib:.2f} GiB" if runs[0].max_memory_gib else ""
                print(
                    f"m={ga}: plain loop (transformers + AdamW, {args.precision}): {t_plain:.3f} s/step "
                    f"(runs: {[round(t, 3) for t in plain]}){memory}",
                    flush=True,
                )
                torch.cuda.empty_cache()
        base, first = None, {}
        for stages in [int(s) for s in args.stages.split(",")]:
            for schedule in schedules if stages > 1 else ["1f1b"]:
                if ga < min_micro_batches(schedule, stages):
                    print(
                        f"m={ga} PP={stages} {schedule}: needs m >= {min_micro_batches(schedule, stages)}, skipped",
                        flush=True,
                    )
                    continue
                step, tokens, padded, peak = measure(hf, data, stages, args, ga, schedule)
                base = base or (step if stages == 1 else None)
                achieved = tokens * flops / stages
                line = f"m={ga} trainer PP={stages} {schedule}: {step:.3f} s/step"
                if t_plain:
                    line += f" ({step / t_plain:.2f}x the plain loop)"
                line += (
                    f", {tokens:.0f} tokens/s ({tokens / stages:.0f} per device; padded {padded:.0f}), "
                    f"{achieved / 1e9:.2f} model GFLOP/s per device"
                )
                if args.peak_tflops:
                    line += f", MFU {achieved / (args.peak_tflops * 1e12):.1%}"
                    if t_plain and stages == 1:  # the same tokens in the plain loop's time
                        line += f" (plain loop {achieved * step / t_plain / (args.peak_tflops * 1e12):.1%})"
                if peak and stages == 1:
                    planned = planned_gib(hf, args, ga)
                    line += f"; peak GPU memory {peak:.2f} GiB, planner {planned:.2f} GiB ({peak / planned - 1:+.1%})"
                if stages > 1:
                    from training.schedules import timeline

                    theory = timeline(schedule, ga, stages)
                    first.setdefault(stages, (step, theory.step_time))
                    line += f"; bubble theory {theory.bubble:.1%}"
                    if base:
                        line += f", measured {1 - base / (stages * step):.1%}"
                    if schedule != "1f1b" and first[stages] and schedules[0] == "1f1b":
                        line += (
                            f"; step time vs 1f1b: measured x{step / first[stages][0]:.3f}, theory "
                            f"x{theory.step_time / first[stages][1]:.3f}"
                        )
                print(line, flush=True)


def measure(hf: str, data: str, stages: int, args, ga: int, schedule: str) -> tuple[float, float, float, float]:
    """Medians over `--repeat` runs of the median step seconds, tokens/s and padded tokens/s after the warm-up, and
    of the peak GPU memory (0 on CPU)."""
    runs = []
    for i in range(args.repeat):
        out = os.path.join(args.work, f"run_pp{stages}_{schedule}_m{ga}_{i}")
        metrics = trainer_run(hf, data, out, stages, args, ga, schedule)[args.warmup :]
        shutil.rmtree(out, ignore_errors=True)
        runs.append(
            (
                statistics.median(m["step_seconds"] for m in metrics),
                statistics.median(m["tokens_per_second"] for m in metrics),
                statistics.median(m["padded_tokens_per_second"] for m in metrics),
                max(m.get("max_memory_allocated_gib", 0.0) for m in metrics),
            )
        )
    return tuple(statistics.median(r[k] for r in runs) for k in range(4))


if __name__ == "__main__":
    main()
