"""PNG plots of a run's metrics.jsonl: loss (and eval loss), learning rate, grad norm, throughput.

    python -m tools.plot_metrics OUTPUT_DIR [--out DIR] [--smooth 20]

Writes OUTPUT_DIR/plots/{loss,lr,grad_norm,throughput}.png and overview.png (all four).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

PANELS = [  # (file stem, metrics key, title, y label, log scale)
    ("loss", "loss", "training loss", "loss (mean over target tokens)", False),
    ("lr", "lr", "learning rate", "lr", False),
    ("grad_norm", "grad_norm", "gradient norm (before clipping)", "global L2 norm", True),
    ("throughput", "tokens_per_second", "throughput", "tokens / s", False),
]


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: missing (the trainer writes it while training)")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ValueError(f"{path}:{lineno}: not valid JSON") from None
    if not rows:
        raise ValueError(f"{path}: no steps recorded yet")
    return rows


def moving_average(values: list[float], window: int) -> list[float]:
    out, total, kept = [], 0.0, []
    for v in values:
        kept.append(v)
        total += v
        if len(kept) > window:
            total -= kept.pop(0)
        out.append(total / len(kept))
    return out


def plot(output_dir: str, out_dir: str | None = None, smooth: int = 0) -> list[str]:
    """Write the PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(output_dir)
    out_dir = out_dir or os.path.join(output_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    eval_path = os.path.join(output_dir, "eval_results.json")
    evaluation = json.load(open(eval_path)) if os.path.exists(eval_path) else None
    smooth = smooth or max(1, len(rows) // 50)
    written = []
    overview, axes = plt.subplots(2, 2, figsize=(12, 8))
    for (stem, key, title, ylabel, log_scale), overview_ax in zip(PANELS, axes.flat, strict=True):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and math.isfinite(r[key])]
        single, single_ax = plt.subplots(figsize=(7, 4))
        for ax in (single_ax, overview_ax):
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(
                    steps, values, color="tab:blue", alpha=0.35 if smooth > 1 and key != "lr" else 1.0, lw=1, label=key
                )
                if smooth > 1 and key != "lr":
                    ax.plot(
                        steps,
                        moving_average(list(values), smooth),
                        color="tab:blue",
                        lw=2,
                        label=f"{key} (mean of {smooth})",
                    )
            if key == "loss" and evaluation:
                ax.scatter(
                    [evaluation["step"]],
                    [evaluation["eval_loss"]],
                    color="tab:red",
                    zorder=3,
                    label=f"eval loss {evaluation['eval_loss']:.3f}",
                )
            if log_scale and points and min(v for _, v in points) > 0:
                ax.set_yscale("log")
            ax.set(title=title, xlabel="optimizer step", ylabel=ylabel)
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        single.tight_layout()
        path = os.path.join(out_dir, f"{stem}.png")
        single.savefig(path, dpi=100)
        plt.close(single)
        written.append(path)
    overview.suptitle(f"{os.path.basename(os.path.abspath(output_dir))}: {len(rows)} steps", fontsize=10)
    overview.tight_layout()
    path = os.path.join(out_dir, "overview.png")
    overview.savefig(path, dpi=100)
    plt.close(overview)
    return [*written, path]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.plot_metrics", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", help="a trainer output_dir (holds metrics.jsonl)")
    parser.add_argument("--out", help="where to write the PNGs (default: OUTPUT_DIR/plots)")
    parser.add_argument("--smooth", type=int, default=0, help="moving-average window (default: steps / 50)")
    args = parser.parse_args(argv)
    try:
        paths = plot(args.output_dir, args.out, args.smooth)
    except (FileNotFoundError, ValueError) as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
