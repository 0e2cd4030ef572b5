"""Where step metrics go, on the reporting rank only: metrics.jsonl (always), a progress bar,
TensorBoard and Weights & Biases (`report_to=[tensorboard,wandb]`, when installed).

W&B honours its own environment (`WANDB_MODE=offline` works with no network; `WANDB_PROJECT`).
"""

from __future__ import annotations

import json
import os
import sys

from checkpoint.staging import write_text_atomic


class StepReporter:
    """Writes each step's record to every sink; `close()` at the end. Build it on the reporting rank."""

    def __init__(
        self,
        output_dir: str,
        report_to: list[str],
        total_steps: int,
        first_step: int,
        run_config: dict,
        progress_bar: bool = True,
    ):
        self.output_dir, self.jsonl = output_dir, None  # metrics.jsonl is opened at the first step
        self.tensorboard = self.wandb = self.bar = None
        if "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        if "wandb" in report_to:
            import wandb

            self.wandb = wandb.init(
                dir=output_dir,
                name=os.path.basename(os.path.abspath(output_dir)),
                config=run_config,
                resume="allow",
                id=_wandb_id(output_dir),
            )
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", mininterval=1.0)

    def step(self, record: dict) -> None:
        if self.jsonl is None:
            self.jsonl = open(os.path.join(self.output_dir, "metrics.jsonl"), "a")
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float) and v is not None}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(f"train/{key}", value, record["step"])
        if self.wandb is not None:
            self.wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=record["step"])
        if self.bar is not None:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(
                loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}", refresh=False
            )

    def evaluation(self, results: dict) -> None:
        if self.tensorboard is not None:
            self.tensorboard.add_scalar("eval/loss", results["eval_loss"], results["step"])
            self.tensorboard.add_scalar("eval/perplexity", results["perplexity"], results["step"])
        if self.wandb is not None:
            self.wandb.log(
                {"eval/loss": results["eval_loss"], "eval/perplexity": results["perplexity"]}, step=results["step"]
            )

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.bar is not None:
            self.bar.refresh()
            self.bar.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_id(output_dir: str) -> str:
    """One W&B run per output_dir, so a resumed job continues the same run."""
    path = os.path.join(output_dir, "wandb_run_id")
    if not os.path.exists(path):
        import uuid

        with open(path, "w") as f:
            f.write(uuid.uuid4().hex[:12])
    with open(path) as f:
        return f.read().strip()


def truncate_metrics(path: str, step: int) -> None:
    """Keep the metrics of steps <= `step` (those after the resumed checkpoint are trained again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    if len(keep) != len(lines):
        write_text_atomic(path, "".join(keep))
