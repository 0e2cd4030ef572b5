"""Training throughput of the trainer against a plain PyTorch loop on the same model, rows and batch.

    python -m benchmarks.train_throughput --work /tmp/trainbench [--stages 1,2] [--packing] [--peak-tflops X]
    python -m benchmarks.train_throughput --work /tmp/trainbench --stages 1,2 --ga 2,4,8 \
        --schedule 1f1b,zero_bubble,dualpipev --skip-plain

Builds (once) a random LLaMA (`--layers`, `--hidden`) with a tokenizer and variable-length rows, then:

- runs `trainer.py` through the DeepSpeed launcher for each number of stages (`--stages`, one rank
  each, DP=1) and reads `metrics.jsonl`: median step time after `--warmup` steps, tokens/s (tokens
  that are not padding) and padded tokens/s, per device too;
- runs a plain loop (transformers `LlamaForCausalLM` + `torch.optim.AdamW`, no DeepSpeed) on the same
  global batches (the trainer's own sampler and collator) in the same precision (fp32 on CPU);
- prints the trainer/plain step-time ratio (PP=1: the pipeline engine's overhead), achieved model
  FLOP/s by PaLM's convention (6N + 12*L*H*Q*T FLOPs per token, N = parameters outside the input
  embedding, L layers, H heads, Q head size, T sequence length) and MFU when `--peak-tflops` is given,
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
import time

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


def trainer_run(
    hf: str, data: str, out: str, stages: int, args, ga: int, schedule: str = "1f1b", ranks: int = 0, extra=()
) -> list[dict]:
    """metrics.jsonl of one trainer launch on `ranks` processes (default `stages`), with more `extra` overrides."""
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (the trainer refuses to mix runs)
    overrides = [
        f"model_name_or_path={hf}",
        f"output_dir={out}",
        f"train_file={data}",
        "do_eval=false",
        f"num_stages={stages}",
        f"seq_length={args.seq}",
        f"micro_batch_size={args.mbs}",
        f"gradient_accumulation_steps={ga}",
        f"max_steps={args.steps}",
        "deepspeed=fp32",
        "progress_bar=false",
        "save_steps=0",
        "save_manifest=false",
        f"data.packing={str(args.packing).lower()}",
        "optim.lr_scheduler=constant",
        f"pipeline_schedule={schedule}",
        *extra,
    ]
    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=REPO)
    cmd = [launcher, "--num_gpus", str(ranks or stages), "trainer.py", *overrides]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def plain_run(hf: str, data: str, args, ga: int) -> list[float]:
    """Step times of transformers + AdamW on the trainer's own batches (its sampler, collator, loss scaling)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    from data.collator import CausalLMCollator
    from data.config import DataConfig
    from data.dataset import TokenizedDataset
    from data.packing import PackedDataset
    from data.sampling import TrainPlan, train_batches
    from models.loss import CausalLMLoss

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    dataset = TokenizedDataset(data, tokenizer, args.seq, DataConfig())
    if args.packing:
        dataset = PackedDataset(dataset, args.seq)
    plan = TrainPlan(len(dataset), 1, args.mbs, ga)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    batches = train_batches(dataset, plan, 0, 42, 0, CausalLMCollator(args.seq, pad, args.packing))
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_fn = CausalLMLoss()
    times = []
    for _ in range(args.steps):
        step = [next(batches) for _ in range(ga)]
        start = time.perf_counter()
        scale = torch.tensor(ga / max(sum(int((lab != -100).sum()) for _, lab, _ in step), 1))
        for (ids, pos), labels, _ in step:
            # NOTE: packed rows need the per-row mask the pipeline builds; HF's own forward gets position_ids
            # only, which is exact for unpacked rows (the benchmark's overhead figure is without packing).
            logits = model(input_ids=ids, position_ids=pos).logits
            (loss_fn(logits, (labels, scale)) / ga).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return times


def model_flops_per_token(config, seq: int) -> float:
    """PaLM (Chowdhery et al. 2022, appendix B): 6N + 12*L*H*Q*T, N without the input embedding."""
    h, layers, inter, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    q = h // heads
    per_layer = h * h * 2 + 2 * h * kv * q + 3 * h * inter  # q, o, k, v, gate/up/down
    n = layers * per_layer + vocab * h  # the LM head is a matmul, the input embedding a lookup
    return 6 * n + 12 * layers * heads * q * seq


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
    args = p.parse_args()
    sys.path.insert(0, REPO)
    os.makedirs(args.work, exist_ok=True)
    hf, data = build(args.work, args.layers, args.hidden, args.heads, args.rows)
    from transformers import AutoConfig

    from training.config import min_micro_batches

    config = AutoConfig.from_pretrained(hf)
    flops = model_flops_per_token(config, args.seq)
    schedules = args.schedule.split(",")
    print(
        f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch {args.mbs}, fp32, "
        f"packing={args.packing}, {args.threads} thread(s)/rank; medians of {args.repeat} runs"
    )
    for ga in [int(m) for m in args.ga.split(",")]:
        t_plain = None
        if not args.skip_plain:
            plain = [statistics.median(plain_run(hf, data, args, ga)[args.warmup :]) for _ in range(args.repeat)]
            t_plain = statistics.median(plain)
            print(
                f"m={ga}: plain loop (LlamaForCausalLM + AdamW): {t_plain:.3f} s/step "
                f"(runs: {[round(t, 3) for t in plain]})"
            )
        base, first = None, {}
        for stages in [int(s) for s in args.stages.split(",")]:
            for schedule in schedules if stages > 1 else ["1f1b"]:
                if ga < min_micro_batches(schedule, stages):
                    print(
                        f"m={ga} PP={stages} {schedule}: needs m >= {min_micro_batches(schedule, stages)}, skipped",
                        flush=True,
                    )
                    continue
                step, tokens, padded = measure(hf, data, stages, args, ga, schedule)
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


def measure(hf: str, data: str, stages: int, args, ga: int, schedule: str) -> tuple[float, float, float]:
    """Median over `--repeat` runs of the median step seconds, tokens/s and padded tokens/s after the warm-up."""
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
            )
        )
    return tuple(statistics.median(r[k] for r in runs) for k in range(3))


if __name__ == "__main__":
    main()
