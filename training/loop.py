"""The run: data per stage, the engine, train/eval loops, checkpoints (set-up helpers: training/setup.py)."""

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

from checkpoint.hf_reader import CheckpointError
from checkpoint.lora_merge import LORA_FILE
from checkpoint.manifest import build_manifest, checkpoint_files, write_manifest
from checkpoint.optimizer_reshape import OPTIMIZER_NAMES, gather_moved_state, load_moved_state, optimizer_param_names
from checkpoint.saves import clean_stale, newest_checkpoint, publish, remove_tree, staging_tag
from checkpoint.universal import check_movable, ensure_universal, layout_changed, read_layout, write_layout
from data.collator import CausalLMCollator
from data.dataset import PlaceholderDataset, TokenizedDataset
from data.sampling import TrainPlan, eval_batches, eval_indices, eval_num_batches, train_batches
from models.lora import add_lora
from models.pipeline import CausalLMLoss, stage_bounds
from training.config import TrainConfig, validate, validate_layout
from training.engine import (
    build_module,
    init_distributed,
    initialize_engine,
    load_layer_files,
    resolve_precision,
    resolve_zero_stage,
)
from training.hf_source import convert_on_load, is_hf_dir
from training.reporting import StepReporter
from training.setup import (
    Coords,
    LossScaledBatches,
    RunError,
    as_float,
    broadcast_row_counts,
    checkpoint_tag,
    configure_logging,
    load_model_config,
    load_tokenizer,
    log_to_file,
    prepare_output_dir,
    restore_rng_state,
    rng_state,
    seed_everything,
    truncate_metrics,
)

log = logging.getLogger("trainer")


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        rank, world = init_distributed(cfg.dist_timeout_minutes)
        self.coords = Coords(rank, world, cfg.num_stages)
        configure_logging(self.coords, cfg.log_all_ranks)
        try:
            validate(cfg)
        except ValueError as e:
            raise RunError(str(e)) from None
        seed_everything(cfg.seed)
        prepare_output_dir(cfg.output_dir)
        if rank == 0:
            for name in clean_stale(cfg.output_dir):
                log.warning("removed %s, left by an interrupted save", os.path.join(cfg.output_dir, name))
        log_to_file(cfg.output_dir, rank)
        self.model_config = load_model_config(cfg)
        try:
            validate_layout(cfg, world, self.model_config.num_hidden_layers)
            stage_bounds(self.model_config, cfg.num_stages, cfg.model.partition)
        except ValueError as e:
            raise RunError(str(e)) from None
        self.tokenizer = load_tokenizer(cfg, self.model_config.vocab_size) if self.coords.has_data else None
        self.num_train_rows, self.num_eval_rows = broadcast_row_counts(cfg)
        self.plan = TrainPlan(
            self.num_train_rows, self.coords.dp, cfg.micro_batch_size, cfg.gradient_accumulation_steps
        )
        if cfg.do_train and self.num_train_rows == 0:
            raise RunError(f"train_file {cfg.train_file}: empty dataset (no JSON rows)")
        if cfg.do_train and self.plan.steps_per_epoch == 0:
            raise RunError(
                f"train_file {cfg.train_file}: {self.num_train_rows} rows give no full step of "
                f"{self.plan.rows_per_step} rows per DP rank x {self.coords.dp} DP ranks"
            )
        self.total_steps = self.plan.total_steps(cfg.max_steps, cfg.num_train_epochs) if cfg.do_train else 0
        self.loss_fn = CausalLMLoss()
        # A resume in another layout goes through DeepSpeed's universal checkpoint (ZeRO-1) or our own
        # reshaping by parameter name (ZeRO-0); weights always come from the layout-free layer files.
        self.universal_tag, self.reshape = None, False
        self.resume_tag = self._find_resume_tag()  # fail now, before building anything
        if self.resume_tag:
            self._prepare_layout_change(self.resume_tag)
        moved = self.universal_tag or self.reshape
        module = build_module(cfg, self.model_config, self.loss_fn, skip_init=cfg.model_name_or_path is not None)
        source = None
        if moved and not cfg.lora.enabled:
            source = (cfg.output_dir, self.resume_tag)
        elif cfg.model_name_or_path and (not self.resume_tag or cfg.lora.enabled):  # LoRA resumes: base, then adapter
            path = self._converted_if_hf(cfg.model_name_or_path)
            source = (path, checkpoint_tag(path))
        if source:
            self.loaded_files = load_layer_files(module, os.path.join(*source))
            log.info("loaded %s (%s): rank %d read %d layer files", *source, rank, len(self.loaded_files))
        if cfg.lora.enabled:
            lo = cfg.lora
            trainable = add_lora(module, lo.r, lo.alpha, lo.dropout, lo.target_modules, cfg.seed)
            log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters on rank %d", lo.r, lo.alpha,
                     lo.target_modules, trainable, rank)  # fmt: skip
            self.lora_base = os.path.abspath(source[0])
            if moved:  # the adapter, saved per global layer like the weights
                load_layer_files(module, os.path.join(cfg.output_dir, self.resume_tag), trainable_only=True)
        self.engine = initialize_engine(cfg, module, max(self.total_steps, 1), load_universal=bool(self.universal_tag))
        self.step = 0
        self.last_saved_step = None
        if self.resume_tag:
            self._resume()
        self.stop_signal, self.stopped, self.reporter = None, False, None
        self.control_group = dist.new_group(backend="gloo")  # a CPU group for the stop flag, under NCCL too
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.collate = CausalLMCollator(cfg.seq_length, self._pad_id())
        self.train_set = self.eval_set = None
        if self.coords.has_data:
            # Rank 0 tokenizes (and fills the cache); the other data ranks then load the cache.
            if rank != 0:
                dist.barrier()
            self._load_datasets()
            if rank == 0:
                dist.barrier()
        else:  # middle stages: the row counts and nothing else
            dist.barrier()
            self.train_set = PlaceholderDataset(self.num_train_rows)
            self.eval_set = PlaceholderDataset(self.num_eval_rows)
        if rank == 0:
            self._write_run_files()
            self._write_data_report()
        dist.barrier()

    # ---------------------------------------------------------------- set-up helpers

    def _pad_id(self) -> int:
        tok = self.tokenizer
        if tok is None:
            return 0
        for candidate in (tok.pad_token_id, tok.eos_token_id, 0):
            if candidate is not None:
                return candidate
        return 0

    def _write_run_files(self) -> None:
        """Resolved config, model config and tokenizer, so output_dir is itself a loadable model dir."""
        os.makedirs(self.cfg.output_dir, exist_ok=True)
        if self.cfg.lora.enabled:  # what `convert2ckpt.py --to-hf --merge-lora` needs
            lo = self.cfg.lora
            info = {"r": lo.r, "alpha": lo.alpha, "target_modules": list(lo.target_modules), "base": self.lora_base}
            with open(os.path.join(self.cfg.output_dir, LORA_FILE), "w") as f:
                json.dump(info, f, indent=2)
        with open(os.path.join(self.cfg.output_dir, "train_config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(OmegaConf.structured(self.cfg)))
        self.model_config.save_pretrained(self.cfg.output_dir)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(self.cfg.output_dir)
        source = self.cfg.model_name_or_path
        target = os.path.join(self.cfg.output_dir, "generation_config.json")
        generation = os.path.join(source, "generation_config.json") if source else ""
        if generation and os.path.exists(generation) and not os.path.exists(target):
            shutil.copy2(generation, target)

    def _load_datasets(self) -> None:
        cfg, d = self.cfg, self.cfg.data
        cache = d.cache_dir if d.cache_dir is not None else os.path.join(cfg.output_dir, "data_cache")
        common = dict(cache_dir=cache or None, workers=d.tokenize_workers)
        if cfg.do_train:
            self.train_set = TokenizedDataset(cfg.train_file, self.tokenizer, cfg.seq_length, d, d.train_weights,
                                              cfg.seed, **common)  # fmt: skip
            lines = self.train_set.no_target_lines
            if lines and self.coords.rank == 0:
                log.warning("%s: %d of %d rows have no target token within seq_length=%d (first: %s)",
                            cfg.train_file, len(lines), len(self.train_set), cfg.seq_length, lines[0])  # fmt: skip
        if cfg.do_eval:
            self.eval_set = TokenizedDataset(cfg.eval_file, self.tokenizer, cfg.seq_length, d, **common)
        for name, ds in (("train", self.train_set), ("eval", self.eval_set)):
            if ds is not None and ds.cache_file and self.coords.rank == 0:
                how = "loaded from" if ds.from_cache else "tokenized and cached in"
                log.info("%s data: %d rows %s %s", name, len(ds), how, ds.cache_file)

    def _write_data_report(self) -> None:
        """output_dir/data_report.json and one log line per file (rank 0 holds the data: it is stage 0)."""
        report = {}
        for name, ds in (("train", self.train_set), ("eval", self.eval_set)):
            if isinstance(ds, TokenizedDataset):
                report[name] = r = ds.report()
                log.info("%s data %s: %d rows, %d tokens, %.1f%% of them targets, %d rows truncated to %d tokens, "
                         "%d rows without targets", name, r["file"], r["rows"], r["tokens"], 100 * r["target_share"],
                         r["truncated_rows"], self.cfg.seq_length, r["rows_without_targets"])  # fmt: skip
        if report:
            with open(os.path.join(self.cfg.output_dir, "data_report.json"), "w") as f:
                json.dump(report, f, indent=2)

    def _converted_if_hf(self, path: str) -> str:
        """A Hugging Face directory is converted for this run (each stage its own layers); see hf_source."""
        if not is_hf_dir(path):
            return path
        c = self.coords
        bounds = stage_bounds(self.model_config, self.cfg.num_stages, self.cfg.model.partition)
        try:
            converted, reused = convert_on_load(path, self.cfg.output_dir, c.rank, c.stage, c.dp_rank, bounds)
        except CheckpointError as e:
            raise RunError(str(e)) from None
        log.info("%s %s as %s", "reusing the conversion of" if reused else "converted", path, converted)
        return converted

    def layout(self) -> dict:
        """What a checkpoint records about the layout that saved it (checkpoint/universal.py)."""
        cfg = self.cfg
        return {
            "num_stages": cfg.num_stages,
            "dp_size": self.coords.dp,
            "stage_bounds": stage_bounds(self.model_config, cfg.num_stages, cfg.model.partition),
            "global_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation_steps * self.coords.dp,
            "num_hidden_layers": self.model_config.num_hidden_layers,
            "precision": resolve_precision(cfg.deepspeed.precision),
            "zero_stage": resolve_zero_stage(cfg.deepspeed.zero_stage),
        }

    def _prepare_layout_change(self, tag: str) -> None:
        """If `tag` was saved with another PP x DP layout, choose how its optimizer state moves.

        ZeRO-0: reshaped by parameter name at load (checkpoint/optimizer_reshape.py); ZeRO-1:
        converted once to a DeepSpeed universal checkpoint by rank 0.
        """
        where = os.path.join(self.cfg.output_dir, tag)
        saved, current = read_layout(where), self.layout()
        if not layout_changed(saved, current):
            return
        try:
            check_movable(saved, current, where)
            if saved.get("zero_stage", 0) == 0:
                self.reshape, how = True, "optimizer state reshaped by parameter name"
            else:
                if self.cfg.lora.enabled:
                    raise CheckpointError(
                        f"{where}: a LoRA run saved with ZeRO-1 cannot move to another layout "
                        "(DeepSpeed's universal checkpoint does not handle frozen weights); train LoRA with "
                        "deepspeed=fp32 to move it, or resume it as saved"
                    )
                universal = [ensure_universal(self.cfg.output_dir, tag) if self.coords.rank == 0 else None]
                dist.broadcast_object_list(universal, src=0)
                self.universal_tag = how = universal[0]
        except CheckpointError as e:
            raise RunError(str(e)) from None
        log.info(
            "resuming %s saved with PP=%d x DP=%d in PP=%d x DP=%d (%s)",
            where,
            saved["num_stages"],
            saved["dp_size"],
            current["num_stages"],
            current["dp_size"],
            how,
        )

    def _find_resume_tag(self) -> str | None:
        """resume=true: the newest complete checkpoint in output_dir, or an error; auto: it or None."""
        cfg = self.cfg
        if cfg.resume == "false":
            return None
        tag = newest_checkpoint(cfg.output_dir)
        if tag is None and cfg.resume == "true":
            raise RunError(
                f"resume=true but output_dir {cfg.output_dir} holds no checkpoint (use resume=auto to start fresh)"
            )
        if tag is None:
            log.info("resume=auto: no checkpoint in %s, starting fresh", cfg.output_dir)
        return tag

    def _resume(self) -> None:
        cfg, tag = self.cfg, self.resume_tag
        if self.reshape:
            client = self._load_reshaped(os.path.join(cfg.output_dir, tag))
        else:
            path, client = self.engine.load_checkpoint(
                cfg.output_dir, tag=self.universal_tag or tag, load_module_strict=not cfg.lora.enabled
            )
            if path is None:
                raise RunError(f"{cfg.output_dir}/{tag}: checkpoint could not be loaded")
        saved = client.get("data", {})
        now = self._data_state()
        for key in ("num_train_rows", "global_batch_size", "seed"):
            if key in saved and saved[key] != now[key]:
                raise RunError(f"resume: {key}={now[key]} but the checkpoint {tag} was saved with {saved[key]}")
        self.step = self.last_saved_step = self.engine.global_steps
        rng_file = os.path.join(cfg.output_dir, tag, f"rng_state_rank{self.coords.rank}.pt")
        if self.universal_tag or self.reshape:
            log.info("layout changed: per-rank RNG states not restored (dropout masks differ from an unmoved run)")
        elif os.path.exists(rng_file):
            restore_rng_state(rng_file)
        else:
            log.warning("%s: missing, RNG states not restored", rng_file)
        if self.coords.reporting:  # drop metrics of steps after the checkpoint (a crash after it was saved)
            truncate_metrics(os.path.join(cfg.output_dir, "metrics.jsonl"), self.step)
        log.info("resumed from %s at step %d", os.path.join(cfg.output_dir, tag), self.step)

    def _load_reshaped(self, step_dir: str) -> dict:
        """ZeRO-0 optimizer state, LR schedule and step counters of this stage's parameters, by name."""
        names = optimizer_param_names(self.engine.module, self.engine.optimizer)
        if names is None:
            raise RunError(f"{step_dir}: ZeRO-0 optimizer state moves into a ZeRO-0 fp32 run only (deepspeed=fp32)")
        saved = read_layout(step_dir)
        try:
            moved = gather_moved_state(step_dir, saved["num_stages"], {n for g in names for n in g})
            load_moved_state(self.engine, names, moved)
        except CheckpointError as e:
            raise RunError(str(e)) from None
        return moved.client_state

    def _data_state(self) -> dict:
        """The data position is a function of the step, given rows, global batch and seed (data/sampling.py)."""
        return {
            "step": self.step,
            "num_train_rows": self.num_train_rows,
            "global_batch_size": self.cfg.micro_batch_size * self.cfg.gradient_accumulation_steps * self.coords.dp,
            "seed": self.cfg.seed,
        }

    def _dp_group(self):
        return self.engine.grid.get_data_parallel_group()

    # ---------------------------------------------------------------- train / eval

    def save(self) -> None:
        """Crash-safe: every rank writes into `.saving-<tag>`; once all are done and the manifest is
        written, rank 0 renames it to `<tag>` and points `latest` at it (checkpoint/saves.py)."""
        cfg, tag = self.cfg, f"global_step{self.step}"
        staging = staging_tag(tag)
        try:
            self._save_into(staging)
            if self.coords.rank == 0:
                for old in publish(cfg.output_dir, tag, cfg.keep_last_n):
                    log.info("keep_last_n=%d: deleted %s", cfg.keep_last_n, os.path.join(cfg.output_dir, old))
        except OSError as e:
            if self.coords.rank == 0:
                remove_tree(os.path.join(cfg.output_dir, staging))
            where = e.filename or os.path.join(cfg.output_dir, staging)
            raise RunError(f"saving checkpoint {tag} failed: {e.strerror or e} ({where}); 'latest' unchanged") from None
        dist.barrier()
        self.last_saved_step = self.step
        log.info("saved checkpoint %s", os.path.join(cfg.output_dir, tag))

    def _save_into(self, staging: str) -> None:
        step_dir = os.path.join(self.cfg.output_dir, staging)
        if self.coords.rank == 0:
            remove_tree(step_dir)
            write_layout(step_dir, self.layout())
        dist.barrier()
        client = {"data": self._data_state()}
        names = optimizer_param_names(self.engine.module, self.engine.optimizer)
        if names is not None:  # lets a ZeRO-0 checkpoint move to another layout
            client[OPTIMIZER_NAMES] = names
        self.engine.save_checkpoint(
            self.cfg.output_dir,
            tag=staging,
            client_state=client,
            save_latest=False,  # `latest` moves in publish(), after the rename
            exclude_frozen_parameters=self.cfg.lora.enabled,  # LoRA: layer files hold the adapter only
        )
        torch.save(rng_state(), os.path.join(step_dir, f"rng_state_rank{self.coords.rank}.pt"))
        dist.barrier()
        if self.cfg.save_manifest:
            self._write_manifest(step_dir)

    def _write_manifest(self, step_dir: str) -> None:
        """Every rank hashes a share of the checkpoint's files; rank 0 writes manifest.json."""
        names = checkpoint_files(step_dir)
        mine = build_manifest(step_dir, names[self.coords.rank :: self.coords.world], sync=True) if names else {}
        gathered = [None] * self.coords.world
        dist.all_gather_object(gathered, mine)
        if self.coords.rank == 0:
            write_manifest(step_dir, {k: v for part in gathered for k, v in part.items()})
        dist.barrier()

    def train(self) -> None:
        cfg, c = self.cfg, self.coords
        data_iter = None
        if c.has_data:
            data_iter = train_batches(
                self.train_set, self.plan, c.dp_rank, cfg.seed, self.step, self.collate, cfg.data.num_workers
            )
            if c.is_last:
                data_iter = LossScaledBatches(data_iter, cfg.gradient_accumulation_steps, self._dp_group(), c.dp)
        reporter = self.reporter
        tokens_per_step = cfg.micro_batch_size * cfg.gradient_accumulation_steps * c.dp * cfg.seq_length
        log.info(
            "training steps %d..%d of %d (%d per epoch), PP=%d x DP=%d",
            self.step + 1,
            self.total_steps,
            self.total_steps,
            self.plan.steps_per_epoch,
            cfg.num_stages,
            c.dp,
        )
        while self.step < self.total_steps:
            lr = self.engine.get_lr()[0]
            start = time.perf_counter()
            loss = self._train_step(data_iter)
            seconds = time.perf_counter() - start
            self.step += 1
            if reporter is not None:
                record = {
                    "step": self.step,
                    "epoch": self.plan.position(self.step - 1)[0],
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": as_float(self.engine.get_global_grad_norm()),
                    "tokens_per_second": tokens_per_step / seconds,
                    "target_tokens": data_iter.step_tokens,
                    "step_seconds": seconds,
                }
                reporter.step(record)
                if self.step % cfg.logging_steps == 0 or self.step == self.total_steps:
                    log.info(
                        "step %d/%d loss %.4f lr %.3g grad_norm %.3f tokens/s %.0f",
                        self.step,
                        self.total_steps,
                        loss,
                        lr,
                        record["grad_norm"] or 0.0,
                        record["tokens_per_second"],
                    )
            if not math.isfinite(loss) and cfg.nonfinite_loss == "skip":
                log.warning("loss is %s at step %d: update skipped (weights and optimizer state unchanged)",
                            loss, self.step)  # fmt: skip
            elif not math.isfinite(loss):
                last = f"global_step{self.last_saved_step}" if self.last_saved_step is not None else "none"
                raise RunError(f"loss is {loss} at step {self.step}; stopped without saving (last checkpoint: {last})")
            if (cfg.save_steps and self.step % cfg.save_steps == 0) or self.step == self.total_steps:
                self.save()
            if self._stop_requested():
                if self.last_saved_step != self.step:
                    self.save()
                log.info("%s: stopped after step %d with a checkpoint; resume with resume=auto", self.stop_signal
                         or "a signal on another rank", self.step)  # fmt: skip
                break
            if cfg.do_eval and cfg.eval_steps and self.step % cfg.eval_steps == 0 and self.step < self.total_steps:
                self.evaluate()

    def _train_step(self, data_iter) -> float:
        """One optimizer step. A failure names the rank and step; the traceback goes to this rank's log."""
        try:
            return float(self.engine.train_batch(data_iter=data_iter))
        except Exception as e:  # noqa: BLE001 - any failure inside a step, ours or a peer's
            log.exception("step %d failed", self.step + 1)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            timed_out = any(s in first for s in ("Timed out", "timed out", "Timeout"))
            lost = isinstance(e, dist.DistError) or any(
                s in first for s in ("Connection closed", "Connection reset", "Broken pipe")
            )
            cause = ""
            if timed_out:
                minutes = self.cfg.dist_timeout_minutes
                cause = f"no answer from another rank for dist_timeout_minutes={minutes} (it hung)"
            elif lost:
                cause = "lost contact with another rank (it died; its own error names the cause)"
            log_file = os.path.join(self.cfg.output_dir, "logs", f"rank{self.coords.rank}.log")
            raise RunError(
                f"rank {self.coords.rank}: step {self.step + 1} failed: {cause or first} ({type(e).__name__}; "
                f"traceback in {log_file})"
            ) from None

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_signal = signal.Signals(signum).name
        log.warning("received %s: saving a checkpoint at the end of this step, then exiting", self.stop_signal)

    def _stop_requested(self) -> bool:
        """Whether any rank got SIGTERM; every rank takes part so that all stop after the same step."""
        flag = torch.tensor([1 if self.stop_signal else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control_group)
        self.stopped = bool(flag.item())
        return self.stopped

    def evaluate(self) -> dict | None:
        """Token-weighted loss over every target token of eval_file; written by the reporting rank."""
        cfg, c = self.cfg, self.coords
        mbs = cfg.eval_micro_batch_size or cfg.micro_batch_size
        micro_batches = cfg.gradient_accumulation_steps
        n_batches = eval_num_batches(self.num_eval_rows, c.dp, mbs, micro_batches)
        data_iter = None
        if c.has_data:
            indices = eval_indices(self.num_eval_rows, c.dp, c.dp_rank, mbs, micro_batches)
            data_iter = eval_batches(self.eval_set, indices, mbs, self.collate)
            if c.is_last:
                data_iter = LossScaledBatches(data_iter, micro_batches, self._dp_group(), c.dp)
        if mbs != cfg.micro_batch_size:
            self.engine.reset_activation_shape()
        self.loss_fn.reset()
        for _ in range(n_batches):
            self.engine.eval_batch(data_iter, num_micro_batches=micro_batches)
        if mbs != cfg.micro_batch_size:
            self.engine.reset_activation_shape()
        results = None
        if c.is_last:
            totals = torch.tensor(self.loss_fn.totals(), dtype=torch.float64)
            if c.dp > 1:
                dist.all_reduce(totals, group=self._dp_group())
            loss_sum, tokens = float(totals[0]), int(totals[1])
            if tokens == 0:
                raise RunError(f"eval_file {cfg.eval_file}: no target tokens to score")
            results = {
                "step": self.step,
                "eval_loss": loss_sum / tokens,
                "eval_tokens": tokens,
                "eval_rows": self.num_eval_rows,
                "perplexity": math.exp(min(loss_sum / tokens, 700.0)),
            }
            if c.reporting:
                with open(os.path.join(cfg.output_dir, "eval_results.json"), "w") as f:
                    json.dump(results, f, indent=2)
                if self.reporter is not None:
                    self.reporter.evaluation(results)
                log.info(
                    "eval at step %d: loss %.4f over %d tokens, perplexity %.3f",
                    self.step,
                    results["eval_loss"],
                    tokens,
                    results["perplexity"],
                )
        self.loss_fn.reset()
        return results

    def run(self) -> None:
        cfg, self.stopped, self.reporter = self.cfg, False, None
        if self.coords.reporting:
            run_config = OmegaConf.to_container(OmegaConf.structured(cfg))
            self.reporter = StepReporter(cfg.output_dir, cfg.report_to, self.total_steps, self.step, run_config,
                                         cfg.progress_bar and cfg.do_train)  # fmt: skip
        try:
            if cfg.do_train:
                self.train()
            if cfg.do_eval and not self.stopped:
                self.evaluate()
        finally:
            if self.reporter is not None:
                self.reporter.close()
        if self.coords.reporting:
            out = os.path.abspath(self.cfg.output_dir)
            lines = [f"output_dir: {out}"]
            if newest_checkpoint(out):
                lines.append(f"  checkpoint: {os.path.join(out, newest_checkpoint(out))} (latest)")
            for name in ("metrics.jsonl", "eval_results.json", "train_config.yaml", "logs"):
                if os.path.exists(os.path.join(out, name)):
                    lines.append(f"  {name}: {os.path.join(out, name)}")
            print("\n".join(lines), flush=True)
        dist.barrier()
