"""The data side of building a run: tokenized datasets (rows or preference pairs), the step plan, what decides
the data order on resume, and the data report."""

from __future__ import annotations

import json
import logging
import os

from data.dataset import PlaceholderDataset, TokenizedDataset, cache_root
from data.open_dataset import open_dataset
from data.packing import BlockDataset, PackedDataset, arranged
from data.pair_dataset import PairDataset
from data.sampling import TrainPlan
from schema.train import TrainConfig, evaluating
from training.distributed import agreed, broadcast_object, rank0_works
from training.errors import RunError
from training.run_state import Run
from training.topology import Coords

log = logging.getLogger("trainer")


def pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return candidate
    return 0


def load_data(run: Run) -> None:
    """Tokenized datasets on the first and last stage, the row counts alone on middle stages, then the step plan.

    Rank 0 finds or builds the tokenized stores (data/store.py) while every other rank waits in short
    collectives (a long build never hits dist_timeout_minutes); the other data ranks then memory-map them.
    Packed rows or blocks (data.packing, data.concatenate) are arranged the same way on every data rank, and
    every rank learns the row counts from rank 0."""
    cfg, c, d = run.cfg, run.coords, run.cfg.data
    cache, run.ephemeral_data = cache_root(d.cache_dir, cfg.output_dir)

    def load(build: bool, beat=None) -> None:
        if cfg.do_train:
            run.train_set = open_dataset(
                cfg, cfg.train_file, run.tokenizer, train=True, cache_dir=cache, build=build, beat=beat
            )
        if evaluating(cfg):
            run.eval_set = open_dataset(
                cfg, cfg.eval_file, run.tokenizer, train=False, cache_dir=cache, build=build, beat=beat
            )

    rank0_works(lambda beat: load(True, beat), f"waiting for rank 0 to find or build the tokenized data in {cache}")
    counts = None
    with agreed():
        if c.has_data and c.rank != 0:
            load(build=False)
        if c.rank == 0:
            _log_rows(run)
        if c.has_data and cfg.objective == "sft":
            if cfg.do_train:
                run.train_set = arranged(run.train_set, d.packing, d.concatenate, cfg.seq_length, train=True)
            if evaluating(cfg):
                run.eval_set = arranged(run.eval_set, d.packing, d.concatenate, cfg.seq_length, train=False)
        if c.rank == 0:
            counts = (len(run.train_set) if cfg.do_train else 0, len(run.eval_set) if evaluating(cfg) else 0)
    num_train_rows, run.num_eval_rows = broadcast_object(counts)
    what = "pairs" if cfg.objective == "dpo" else "blocks" if d.concatenate else "packed rows" if d.packing else "rows"
    run.plan, run.total_steps = train_plan(cfg, c, num_train_rows, what)
    if not c.has_data:
        run.train_set = PlaceholderDataset(run.plan.num_rows)
        run.eval_set = PlaceholderDataset(run.num_eval_rows)


def _log_rows(run: Run) -> None:
    """Rank 0: where the rows come from, and rows that teach nothing."""
    cfg = run.cfg
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        if isinstance(ds, TokenizedDataset | PairDataset):
            how = "found" if ds.from_cache else "built"
            what = "pairs" if isinstance(ds, PairDataset) else "rows"
            log.info("%s data: %d %s, tokenized store %s %s", name, len(ds), what, how, ", ".join(ds.store_dirs))
    if isinstance(run.train_set, PairDataset) and run.train_set.report()["pairs_without_targets"]:
        r = run.train_set.report()
        log.warning(
            "%s: %d of %d pairs keep no completion token within seq_length=%d and score nothing (first: %s)",
            cfg.train_file,
            r["pairs_without_targets"],
            r["pairs"],
            cfg.seq_length,
            (r["no_target_examples"] or ["?"])[0],
        )
    if isinstance(run.train_set, TokenizedDataset):
        missing = run.train_set.report()["rows_without_targets"]
        if missing:
            first = (run.train_set.no_target_examples or ["?"])[0]
            log.warning(
                "%s: %d of %d rows have no target token within seq_length=%d (first: %s)",
                cfg.train_file,
                missing,
                len(run.train_set),
                cfg.seq_length,
                first,
            )
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        report = ds.report() if isinstance(ds, TokenizedDataset) else {}
        if report.get("rows_with_lost_characters"):
            log.warning(
                "%s data: %d rows hold characters the tokenizer drops or replaces by an unknown token "
                "(first: %s); see data_report.json",
                name,
                report["rows_with_lost_characters"],
                report["lost_character_examples"][0],
            )


def train_plan(cfg: TrainConfig, coords: Coords, num_rows: int, what: str = "rows") -> tuple[TrainPlan, int]:
    """(the plan of which rows each step reads, total optimizer steps); RunError if the rows make no full step."""
    plan = TrainPlan(num_rows, coords.dp, cfg.micro_batch_size, cfg.gradient_accumulation_steps)
    if cfg.do_train and plan.steps_per_epoch == 0:
        raise RunError(
            f"train_file {cfg.train_file}: {num_rows} {what} give no full step of "
            f"{plan.rows_per_step} rows per DP rank x {coords.dp} DP ranks"
        )
    return plan, plan.total_steps(cfg.max_steps, cfg.num_train_epochs) if cfg.do_train else 0


def data_state(run: Run) -> dict:
    """What decides which rows each step reads, the same on every rank (the stores' fingerprints, from rank 0)."""
    cfg = run.cfg
    digest = run.train_set.fingerprint() if run.coords.rank == 0 and cfg.do_train else None
    return {
        "num_train_rows": run.plan.num_rows,
        "global_batch_size": run.coords.global_batch(cfg.micro_batch_size, cfg.gradient_accumulation_steps),
        "seed": cfg.seed,
        "seq_length": cfg.seq_length,
        "train_weights": list(cfg.data.train_weights) if cfg.data.train_weights else None,
        "packing": cfg.data.packing,
        "concatenate": cfg.data.concatenate,
        "train_data_fingerprint": broadcast_object(digest),
        "objective": str(cfg.objective),  # a plain string: the state is pickled into checkpoints
    }


def write_data_report(run: Run) -> None:
    """Rank 0: data_report.json (and its log lines): rows or pairs, tokens, truncation, rows without targets."""
    cfg = run.cfg
    report = {}
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        if isinstance(ds, PairDataset):
            report[name] = r = ds.report()
            log.info(
                "%s data %s: %d pairs, %d tokens, %d completion tokens, %d pairs truncated to %d tokens, %d pairs "
                "without completion tokens",
                name,
                r["file"],
                r["pairs"],
                r["tokens"],
                r["target_tokens"],
                r["truncated_pairs"],
                cfg.seq_length,
                r["pairs_without_targets"],
            )
        if isinstance(ds, (TokenizedDataset, PackedDataset, BlockDataset)):
            report[name] = r = ds.report()
            log.info(
                "%s data %s: %d rows, %d tokens, %.1f%% of them targets, %d rows truncated to %d tokens, "
                "%d rows without targets",
                name,
                r["file"],
                r["rows"],
                r["tokens"],
                100 * r["target_share"],
                r["truncated_rows"],
                cfg.seq_length,
                r["rows_without_targets"],
            )
            if "packed_rows" in r:
                log.info(
                    "%s data packed: %d rows in %d rows of %d tokens (%.2f per row), padding %.1f%% -> %.1f%%",
                    name,
                    r["rows"],
                    r["packed_rows"],
                    cfg.seq_length,
                    r["rows_per_packed_row"],
                    100 * r["padding_share_unpacked"],
                    100 * r["padding_share_packed"],
                )
            if "blocks" in r:
                log.info(
                    "%s data concatenated: %d documents in %d blocks of %d tokens, %d tokens of a partial block "
                    "dropped",
                    name,
                    r["rows"],
                    r["blocks"],
                    cfg.seq_length,
                    r["tokens_dropped"],
                )
    if report:
        with open(os.path.join(cfg.output_dir, "data_report.json"), "w") as f:
            json.dump(report, f, indent=2)
