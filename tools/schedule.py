"""Draw a pipeline schedule: each rank's timeline, replayed from the instruction lists its engine executes.

    python -m tools.schedule --stages 4 --micro-batches 8 --schedule zero_bubble [--png schedule.png]
        [--forward 1 --backward 2 --weight 1]

Prints, per rank, a row of time units (F forward, B backward, W deferred weight gradients, `.` waiting; digits
or letters say which micro-batch), the step time and the bubble (the idle share of all ranks), next to 1F1B's
theoretical bubble (p - 1) / (m + p - 1). The timeline comes from training/schedules.py's `timeline()`, which
executes the very `PipeInstruction` lists the engines run, with blocking point-to-point semantics.
"""

from __future__ import annotations

import argparse
import sys

from training.schedules import Costs, timeline

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def text(tl, stages: int, unit: float) -> list[str]:
    """Two rows per rank: what it computes in each time unit (F, B, W; lower case: DualPipeV's returning phase;
    `.` waiting), and for which micro-batch."""
    width = int(round(tl.step_time / unit))
    rows = []
    for stage in range(stages):
        kinds, batches = ["."] * width, [" "] * width
        for span in (s for s in tl.spans if s.stage == stage):
            for i in range(int(round(span.start / unit)), int(round(span.end / unit))):
                kinds[i] = span.kind.lower() if span.phase else span.kind
                batches[i] = SYMBOLS[span.micro_batch % len(SYMBOLS)] if span.micro_batch >= 0 else "?"
        rows += [f"rank {stage:>2} |{''.join(kinds)}|", f"        |{''.join(batches)}|"]
    return rows


def png(tl, stages: int, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
    fig, ax = plt.subplots(figsize=(max(6, tl.step_time * 0.35), 0.6 * stages + 1.2))
    for span in tl.spans:
        ax.barh(
            stages - 1 - span.stage,
            span.end - span.start,
            left=span.start,
            color=colors[span.kind],
            edgecolor="white",
            alpha=0.6 if span.phase else 1.0,
        )
        ax.text(
            (span.start + span.end) / 2,
            stages - 1 - span.stage,
            str(span.micro_batch),
            ha="center",
            va="center",
            fontsize=7,
            color="white",
        )
    ax.set_yticks(range(stages), [f"rank {s}" for s in reversed(range(stages))])
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(
        handles, ["forward", "backward (input grads with zero_bubble)", "weight grads"], fontsize=7, loc="upper right"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.schedule", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, required=True, help="pipeline ranks")
    p.add_argument("--micro-batches", type=int, required=True, help="gradient_accumulation_steps")
    p.add_argument("--schedule", choices=("1f1b", "zero_bubble", "dualpipev"), default="1f1b")
    p.add_argument("--forward", type=float, default=1.0, help="time of a forward through one 1F1B stage")
    p.add_argument("--backward", type=float, default=2.0, help="time of its whole backward")
    p.add_argument("--weight", type=float, default=1.0, help="the weight-gradient part of that backward")
    p.add_argument("--png", help="also draw it into this PNG file")
    args = p.parse_args(argv)
    costs = Costs(args.forward, args.backward, args.weight)
    try:
        tl = timeline(args.schedule, args.micro_batches, args.stages, costs)
        base = timeline("1f1b", args.micro_batches, args.stages, costs)
    except ValueError as e:  # DualPipeV with too few micro-batches
        print(f"schedule: error: {e}", file=sys.stderr)
        return 2
    unit = min(costs.forward, costs.backward - costs.weight, costs.weight) / (2 if args.schedule == "dualpipev" else 1)
    print("\n".join(text(tl, args.stages, unit)))
    p_, m = args.stages, args.micro_batches
    ratio = tl.step_time / base.step_time
    print(
        f"{args.schedule}: step time {tl.step_time:g} (1f1b {base.step_time:g}, ratio {ratio:.3f}), bubble "
        f"{tl.bubble:.1%}; 1F1B theory (p - 1) / (m + p - 1) = {(p_ - 1) / (m + p_ - 1):.1%}"
    )
    if args.png:
        png(tl, args.stages, args.png, f"{args.schedule}, {p_} ranks, {m} micro-batches: bubble {tl.bubble:.1%}")
        print(f"drawn: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
