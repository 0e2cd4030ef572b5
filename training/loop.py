"""The training loop: steps, evaluation, saves, stop requests and failures (the run is built in assembly.py)."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from checkpoint.names import step_tag
from checkpoint.saves import newest_checkpoint
from data.sampling import eval_batches, eval_indices, eval_num_batches, train_batches
from schema.train import (
    TrainConfig,
    eval_micro_batch_size,
    evaluating,
    padded_seq_length,
    resume_mode,
    sequences_per_sample,
)
from training.assembly import assemble
from training.balancing import balance_experts
from training.batches import LossScaledBatches, PairScaledBatches
from training.distributed import control_group
from training.errors import RunError
from training.logs import rank_log_path
from training.reporting import StepReporter, truncate_metrics
from training.saving import Saver

log = logging.getLogger("trainer")


def as_float(value) -> float | None:
    """DeepSpeed reports the grad norm as a float (fp32 path) or a 0-d tensor (bf16/ZeRO optimizers)."""
    return None if value is None else float(value)


def describe_failure(error: Exception, rank: int, step: int, timeout_minutes: float, log_file: str) -> str:
    """One line for a failure inside a step: a peer that hung or died, or this rank's own error."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    cause = first
    if any(s in first for s in ("Timed out", "timed out", "Timeout")):
        cause = f"no answer from another rank for dist_timeout_minutes={timeout_minutes} (it hung)"
    elif isinstance(error, dist.DistError) or any(
        s in first for s in ("Connection closed", "Connection reset", "Broken pipe")
    ):
        cause = "lost contact with another rank (it died; its own error names the cause)"
    return f"rank {rank}: step {step} failed: {cause} ({type(error).__name__}; traceback in {log_file})"


def host_rss_bytes() -> int:
    """This process's resident memory now (VmRSS; 0 where /proc is not)."""
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def host_peak_rss_bytes() -> int:
    """This process's peak resident memory since it started (ru_maxrss)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.assembled = assemble(cfg)
        r = self.assembled
        self.saver = Saver(r.engine, cfg, r.coords, r.layout)
        self.last_saved_step = self.assembled.step if self.assembled.step else None
        self.stop_signal, self.stopped, self.reporter = None, False, None
        signal.signal(signal.SIGTERM, self._on_sigterm)
        if resume_mode(cfg) != "false" and self.assembled.coords.reporting:
            # Drop metrics of steps after the resumed checkpoint (all of them when a launch killed before its
            # first save starts fresh): those steps are trained again.
            truncate_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"), self.assembled.step)

    # ---------------------------------------------------------------- train

    def save(self) -> float:
        """Save this step (training/saving.py); the seconds the loop was blocked."""
        r = self.assembled
        blocked = self.saver.save(r.step, r.data_state)
        self.last_saved_step = r.step
        return blocked

    def train(self) -> None:
        cfg, r, c = self.cfg, self.assembled, self.assembled.coords
        data_iter = None
        if c.has_data:
            data_iter = train_batches(r.train_set, r.plan, c.dp_rank, cfg.seed, r.step, r.collate, cfg.data.num_workers)
            if c.is_last:
                data_iter = self._scaled(data_iter, cfg.gradient_accumulation_steps)
        tokens_per_step = c.global_batch(cfg.micro_batch_size, cfg.gradient_accumulation_steps) * padded_seq_length(cfg)
        tokens_per_step *= sequences_per_sample(cfg)
        log.info(
            "training steps %d..%d of %d (%d per epoch), PP=%d x TP=%d x CP=%d x DP=%d",
            r.step + 1,
            r.total_steps,
            r.total_steps,
            r.plan.steps_per_epoch,
            cfg.num_stages,
            c.tp,
            c.cp,
            c.dp,
        )
        while r.step < r.total_steps:
            lr = r.engine.get_lr()[0]
            # what the reporting rank holds before the step (weights, optimizer state, data)
            resident = host_rss_bytes() if self.reporter is not None else 0
            start = time.perf_counter()
            loss = self._train_step(data_iter)
            if cfg.moe.bias_update_rate:  # a skipped step (non-finite loss) balances nothing and forgets its loads
                rate = cfg.moe.bias_update_rate if math.isfinite(loss) else 0.0
                balance_experts(r.engine.module, rate, r.dp_group(), c.cp)
            seconds = time.perf_counter() - start
            r.step += 1
            extra = self._router_metrics() if c.is_last else {}
            if cfg.objective == "dpo" and c.is_last:
                extra.update(self._preference_metrics())
            if self.reporter is not None:
                extra.update(rss_before_step_gib=resident / 2**30, peak_rss_gib=host_peak_rss_bytes() / 2**30)
            stop = not math.isfinite(loss) and cfg.nonfinite_loss != "skip"
            if not stop and ((cfg.save_steps and r.step % cfg.save_steps == 0) or r.step == r.total_steps):
                extra["save_seconds"] = self.save()  # the time the loop was blocked
            if self.reporter is not None:
                self._report(loss, lr, seconds, tokens_per_step, data_iter, extra)
            if not math.isfinite(loss) and not stop:
                log.warning(
                    "loss is %s at step %d: update skipped (weights and optimizer state unchanged)", loss, r.step
                )
            elif stop:
                self.saver.finish()  # every rank stops here: the save in flight is committed first
                last = step_tag(self.last_saved_step) if self.last_saved_step is not None else "none"
                raise RunError(f"loss is {loss} at step {r.step}; stopped without saving (last checkpoint: {last})")
            if self._stop_requested():
                if self.last_saved_step != r.step:
                    self.save()  # committed by the `finish` after the loop
                log.info(
                    "%s: stopped after step %d with a checkpoint; resume with resume=auto",
                    self.stop_signal or "a signal on another rank",
                    r.step,
                )
                break
            if evaluating(cfg) and cfg.eval_steps and r.step % cfg.eval_steps == 0 and r.step < r.total_steps:
                self.evaluate()
        self.saver.finish()  # the last save committed before the run reports its checkpoint

    def _scaled(self, batches, micro_batches: int) -> LossScaledBatches:
        """The last stage's micro-batches with their loss scales (pairs for objective=dpo)."""
        r = self.assembled
        if self.cfg.objective == "dpo":
            return PairScaledBatches(batches, micro_batches, r.dp_group(), r.coords.data_ranks, r.loss_fn.context)
        return LossScaledBatches(batches, micro_batches, r.dp_group(), r.coords.data_ranks)

    def _router_metrics(self, prefix: str = "") -> dict:
        """Last stage of a model with experts: the load-balancing loss (mean over the micro-batches since the last
        call, over the DP group) and the largest expert load (busiest expert's tokens over the mean, any layer)."""
        r = self.assembled
        if not hasattr(r.loss_fn, "router_sums"):
            return {}
        sums = r.loss_fn.router_sums if r.loss_fn.router_sums is not None else torch.zeros(3, dtype=torch.float64)
        sums = sums.detach().to("cpu", torch.float64)
        r.loss_fn.router_sums = None
        if r.coords.data_ranks > 1:
            load = sums[2:].clone()
            dist.all_reduce(sums, group=r.dp_group())
            dist.all_reduce(load, op=dist.ReduceOp.MAX, group=r.dp_group())
            sums[2:] = load
        return {f"{prefix}aux_loss": float(sums[0] / sums[1].clamp_min(1)), f"{prefix}expert_load_max": float(sums[2])}

    def _preference_metrics(self, prefix: str = "") -> dict:
        """Last stage, objective=dpo: the loss and TRL's reward means over every pair scored since the last call (the
        step's, or the evaluation's), summed over the DP group (`prefix`: "eval_" for TRL's evaluation names)."""
        r = self.assembled
        sums = r.loss_fn.sums if r.loss_fn.sums is not None else torch.zeros(len(r.loss_fn.SUMS))
        sums = sums.detach().to("cpu", torch.float64)
        r.loss_fn.reset()
        if r.coords.cp_rank > 0:  # the C ranks of a CP group hold the same pairs' sums: counted once
            sums = torch.zeros_like(sums)
        if r.coords.data_ranks > 1:
            dist.all_reduce(sums, group=r.dp_group())
        return {f"{prefix}{k}": v for k, v in r.loss_fn.totals(sums).items()}

    def _report(
        self,
        loss: float,
        lr: float,
        seconds: float,
        tokens_per_step: int,
        batches: LossScaledBatches,
        extra: dict | None = None,
    ) -> None:
        r = self.assembled
        record = {
            "step": r.step,
            "epoch": r.plan.position(r.step - 1)[0],
            "loss": loss,
            "lr": lr,
            "grad_norm": as_float(r.engine.get_global_grad_norm()),
            "tokens_per_second": batches.step_input_tokens / seconds,  # tokens that are not padding
            "padded_tokens_per_second": tokens_per_step / seconds,  # every position of every row
            "target_tokens": batches.step_tokens,
            "input_tokens": batches.step_input_tokens,
            "step_seconds": seconds,
        }
        if torch.cuda.is_available():  # this reporting rank's peak since the start, for the memory planner
            record["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if extra:  # experts: aux_loss, expert_load_max; dpo: TRL's reward means over the step's pairs (`loss` above)
            record.update({k: v for k, v in extra.items() if k != "loss"})
        self.reporter.step(record)
        if r.step % self.cfg.logging_steps == 0 or r.step == r.total_steps:
            log.info(
                "step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f",
                r.step,
                r.total_steps,
                loss,
                lr,
                record["grad_norm"] or 0.0,
                record["tokens_per_second"],
            )

    def _train_step(self, data_iter) -> float:
        """One optimizer step. A failure names the rank and step; the traceback goes to this rank's log."""
        r = self.assembled
        try:
            return float(r.engine.train_batch(data_iter=data_iter))
        except Exception as e:  # noqa: BLE001 - any failure inside a step, ours or a peer's
            log.exception("step %d failed", r.step + 1)
            log_file = rank_log_path(self.cfg.output_dir, r.coords.rank)
            raise RunError(
                describe_failure(e, r.coords.rank, r.step + 1, self.cfg.dist_timeout_minutes, log_file)
            ) from None

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_signal = signal.Signals(signum).name
        log.warning("received %s: saving a checkpoint at the end of this step, then exiting", self.stop_signal)

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM; every rank takes part so that all stop after the same step. The same
        all-reduce tells whether every rank has written the save in flight, which then commits."""
        flags = torch.tensor([1 if self.stop_signal else 0, *self.saver.poll_flags()], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=control_group())
        self.saver.after_flags(int(flags[1]), int(flags[2]))
        self.stopped = bool(flags[0])
        return self.stopped

    # ---------------------------------------------------------------- eval

    def evaluate(self) -> dict | None:
        """Token-weighted loss over every target token of eval_file; written by the reporting rank."""
        cfg, r, c = self.cfg, self.assembled, self.assembled.coords
        mbs = eval_micro_batch_size(cfg)
        micro_batches = cfg.gradient_accumulation_steps
        data_iter = None
        if c.has_data:
            indices = eval_indices(r.num_eval_rows, c.dp, c.dp_rank, mbs, micro_batches)
            data_iter = eval_batches(r.eval_set, indices, mbs, r.collate)
            if c.is_last:
                data_iter = self._scaled(data_iter, micro_batches)
        if mbs != cfg.micro_batch_size:
            r.engine.reset_activation_shape()
        r.loss_fn.reset()
        for _ in range(eval_num_batches(r.num_eval_rows, c.dp, mbs, micro_batches)):
            r.engine.eval_batch(data_iter, num_micro_batches=micro_batches)
        if mbs != cfg.micro_batch_size:
            r.engine.reset_activation_shape()
        results = None
        router = self._router_metrics("eval_") if c.is_last else {}
        if c.is_last and cfg.objective == "dpo":
            results = {
                "step": r.step,
                **self._preference_metrics("eval_"),
                **router,
            }  # PairDataset refuses pairless files
            self._write_results(results)
            log.info(
                "eval at step %d: loss %.4f over %d pairs, reward accuracy %.3f, margin %.4f",
                r.step,
                results["eval_loss"],
                results["eval_pairs"],
                results["eval_rewards/accuracies"],
                results["eval_rewards/margins"],
            )
        elif c.is_last:
            totals = torch.tensor(r.loss_fn.totals(), dtype=torch.float64)
            if c.data_ranks > 1:
                dist.all_reduce(totals, group=r.dp_group())
            loss_sum, tokens = float(totals[0]), int(totals[1])
            if tokens == 0:
                raise RunError(f"eval_file {cfg.eval_file}: no target tokens to score")
            results = {
                "step": r.step,
                "eval_loss": loss_sum / tokens,
                "eval_tokens": tokens,
                "eval_rows": r.num_eval_rows,
                "perplexity": math.exp(min(loss_sum / tokens, 700.0)),
                **router,
            }
            self._write_results(results)
            if c.reporting:
                log.info(
                    "eval at step %d: loss %.4f over %d tokens, perplexity %.3f",
                    r.step,
                    results["eval_loss"],
                    tokens,
                    results["perplexity"],
                )
        r.loss_fn.reset()
        return results

    def _write_results(self, results: dict) -> None:
        if self.assembled.coords.reporting:
            with open(os.path.join(self.cfg.output_dir, "eval_results.json"), "w") as f:
                json.dump(results, f, indent=2)
            if self.reporter is not None:
                self.reporter.evaluation(results)

    # ---------------------------------------------------------------- the whole run

    def run(self) -> None:
        cfg, r, self.stopped, self.reporter = self.cfg, self.assembled, False, None
        if r.coords.reporting:
            run_config = OmegaConf.to_container(OmegaConf.structured(cfg))
            self.reporter = StepReporter(
                cfg.output_dir, cfg.report_to, r.total_steps, r.step, run_config, cfg.progress_bar and cfg.do_train
            )
        try:
            if cfg.do_train:
                self.train()
            if evaluating(cfg) and not self.stopped:
                self.evaluate()
        except BaseException:
            # A rank failed (or all did): a save every rank finished writing is still published (no collectives).
            self.saver.salvage(seconds=min(60.0, cfg.dist_timeout_minutes * 60))
            raise
        finally:
            if self.reporter is not None:
                self.reporter.close()
        if r.coords.reporting:
            out = os.path.abspath(cfg.output_dir)
            lines = [f"output_dir: {out}"]
            if newest_checkpoint(out):
                lines.append(f"  checkpoint: {os.path.join(out, newest_checkpoint(out))} (latest)")
            for name in ("metrics.jsonl", "eval_results.json", "train_config.yaml", "logs"):
                if os.path.exists(os.path.join(out, name)):
                    lines.append(f"  {name}: {os.path.join(out, name)}")
            print("\n".join(lines), flush=True)
        dist.barrier()
        if r.ephemeral_data and r.coords.rank == 0:  # data.cache_dir="": the stores lived for this run only
            from data.dataset import cache_root

            shutil.rmtree(cache_root("", cfg.output_dir)[0], ignore_errors=True)
