"""How long a row trains per rank memory budget, at context-parallel sizes C = 1, 2, 4 (the tiny long-row model).

    python -m benchmarks.long_context --work /tmp/longbench [--cp 1,2,4] [--shards 8192,16384,32768]
        [--budget-gib 20] [--mlp-tiles 8]

For each C: one training step through PP=1 x CP=C (torchrun, C ranks, tests/workers/long_rows.py) on one row of
C x shard tokens for each `--shards` value (each rank holds `shard` positions), every block recomputed, the MLPs in
`--mlp-tiles` tiles and the loss in chunks of 4,096: the settings a long row needs. Each rank reports its peak
resident memory (ru_maxrss: imports, weights, optimizer state and the step's peak together) and the peak bytes
autograd saved in its forward (what the planner counts). The longest row whose every rank stays within
`--budget-gib` (a GPU of that size per rank) is extrapolated along the busiest rank's peak, with the slope between
the two longest rows measured.

Why an extrapolation, not a search: on this machine (2 cores) attention's time grows with the square of the row, and
a row that fills 20 GiB with this model (hidden 64) has millions of tokens: hours per step. The points measured are
the ones printed.

Not a test: timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3


def build_model(work: Path) -> str:
    """The long-row model of the tests (2 layers, hidden 64, 4 heads, 2 KV heads), converted once."""
    ckpt = work / "ckpt"
    if (ckpt / "latest").exists():
        return str(ckpt)
    from tools.tiny_models import make_hf_model, tiny_config

    hf = work / "hf"
    make_hf_model(str(hf), tiny_config(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=1 << 24))
    cmd = [sys.executable, "convert2ckpt.py", "--input", str(hf), "--output", str(ckpt)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    return str(ckpt)


def one_step(ckpt: str, out: Path, cp: int, seq: int, args) -> dict:
    """Launch one step of PP=1 x CP=`cp` on a row of `seq` tokens; the ranks' records, the launch's wall time."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}"]
    cmd += ["tests/workers/long_rows.py", ckpt, str(out), "--stages", "1", "--cp", str(cp), "--seq", str(seq)]
    cmd += ["--mlp-tiles", str(args.mlp_tiles)] if args.mlp_tiles > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"C={cp}, {seq} tokens failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(cp)]
    return {"ranks": ranks, "wall": time.perf_counter() - start}


def slope(points: list[tuple[int, int]]) -> tuple[float, float]:
    """(bytes per row token between the two longest rows, the line's value at 0 tokens)."""
    (x0, y0), (x1, y1) = sorted(points)[-2:]
    b = (y1 - y0) / (x1 - x0)
    return b, y1 - b * x1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="where the model and the runs go")
    p.add_argument("--cp", default="1,2,4", help="context-parallel sizes")
    p.add_argument("--shards", default="8192,16384,32768", help="positions per rank of the rows measured")
    p.add_argument("--budget-gib", type=float, default=20.0, help="memory of one rank")
    p.add_argument("--mlp-tiles", type=int, default=8)
    args = p.parse_args()
    work = Path(args.work)
    ckpt = build_model(work)
    budget = args.budget_gib * GIB
    print(
        "| C | row tokens | busiest rank's peak RSS | its RSS before the step | saved for backward per rank | step s "
        "| loss |"
    )
    print("|---|---|---|---|---|---|---|")
    summary = []
    for cp in [int(c) for c in args.cp.split(",")]:
        points = []
        for shard in [int(s) for s in args.shards.split(",")]:
            seq = cp * shard
            ranks = one_step(ckpt, work / f"cp{cp}_{seq}", cp, seq, args)["ranks"]
            peak = max(r["peak_rss_bytes"] for r in ranks)
            before = max(r["rss_before_step_bytes"] for r in ranks)
            saved = max(r["peak_saved_bytes"] for r in ranks)
            step = max(r["step_seconds"] for r in ranks)
            points.append((seq, peak))
            print(
                f"| {cp} | {seq:,} | {peak / GIB:.3f} GiB | {before / GIB:.3f} GiB | {saved / 2**20:.1f} MiB | "
                f"{step:.1f} | {ranks[0]['loss']:.6f} |"
            )
        b, a = slope(points)
        summary.append((cp, b, int((budget - a) / b) if b > 0 else 0))
    print(
        f"\nlongest row with every rank within {args.budget_gib:g} GiB, along the slope between the two longest rows:"
    )
    print("| C | peak RSS per row token | longest row (extrapolated) | vs C=1 |")
    print("|---|---|---|---|")
    for cp, b, longest in summary:
        print(f"| {cp} | {b:,.0f} bytes | {longest:,} tokens | x{longest / max(summary[0][2], 1):.2f} |")


if __name__ == "__main__":
    main()
