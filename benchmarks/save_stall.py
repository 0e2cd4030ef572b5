"""What a save costs the training loop: runs that save every step against runs that save only at the end.

    python -m benchmarks.save_stall --work /tmp/savebench [--precision fp32,bf16] [--async-save true,false]

SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, MLP 1536, vocab 49152, tied; random weights: with
fp32 Adam about 1.6 GB of state), PP=2 on 2 ranks, rows of `--seq` tokens, 2 micro-batches a step, `--steps` steps,
for each precision (`fp32`: fp32 + Adam, ZeRO-0; `bf16`: `bf16_zero1`) and each `checkpoint.async_save`:

- blocked: the median `save_seconds` (metrics.jsonl: the time the loop stood still for a save), against the median
  step of the run that saves only at the end;
- end to end: (wall time saving every `--save-steps` steps - wall time saving at the end) / (saves - 1), the cost
  of each extra save, against the same median step (the background writer shares this machine's cores with the ranks);
- the losses of the two runs, which must be equal bit for bit (a save changes nothing a later step computes).

Medians over `--repeat` launches of each. Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_135M = dict(
    num_key_value_heads=3, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, head_dim=64
)


def run(hf: str, data: str, out: str, args, precision: str, async_save: str, save_steps: int) -> tuple[list, float]:
    from benchmarks.train_throughput import trainer_run

    args.precision = precision
    extra = [f"checkpoint.async_save={async_save}", f"save_steps={save_steps}", "save_manifest=true"]
    start = time.perf_counter()
    metrics = trainer_run(hf, data, out, 2, args, 2, extra=extra)
    wall = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return metrics, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--precision", default="fp32,bf16")
    p.add_argument("--async-save", default="true,false")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-steps", type=int, default=1, help="the saving run saves every this many steps")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--mbs", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, REPO)
    from benchmarks.train_throughput import build

    args.packing = False
    hf, data = build(args.work, 30, 576, 9, 2000, **SMOLLM2_135M)
    print(f"SmolLM2-135M shape, PP=2 on 2 ranks, {args.steps} steps of 2 x {args.mbs} x {args.seq} tokens", flush=True)
    for precision in args.precision.split(","):
        for async_save in args.async_save.split(","):
            every, end, blocked, steps, same = [], [], [], [], True
            for i in range(args.repeat):
                base = os.path.join(args.work, f"run_{precision}_{async_save}_{i}")
                m_every, w_every = run(hf, data, base + "_every", args, precision, async_save, args.save_steps)
                m_end, w_end = run(hf, data, base + "_end", args, precision, async_save, 0)
                every.append(w_every)
                end.append(w_end)
                blocked += [m["save_seconds"] for m in m_every[:-1] if "save_seconds" in m]  # the last one waits
                steps += [m["step_seconds"] for m in m_end[1:]]
                same &= [m["loss"] for m in m_every] == [m["loss"] for m in m_end]
            step = statistics.median(steps)
            extra = (statistics.median(every) - statistics.median(end)) / (args.steps // args.save_steps - 1)
            print(
                f"{precision} async_save={async_save}: median step {step:.3f} s; blocked per save "
                f"{statistics.median(blocked):.3f} s ({statistics.median(blocked) / step:.2f} of a step); each extra "
                f"save end to end {extra:.3f} s ({extra / step:.2f} of a step); wall {statistics.median(every):.1f} s "
                f"saving every {args.save_steps} step(s) vs {statistics.median(end):.1f} s; "
                f"losses bit-identical: {same}",
                flush=True,
            )
            assert same, "saving changed the losses"  # the figure is reported; this one is held


if __name__ == "__main__":
    main()
