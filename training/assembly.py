"""Building a run from its config: topology, model config, data, the stage, the engine, a resume.

Every piece of set-up that can fail on some ranks only (rank 0 counts and tokenizes, each stage reads
its own layer files, data ranks load the tokenizer) runs inside `agreed()`: all ranks learn of a failure
and exit with the same one line (training/distributed.py).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from checkpoint.hf_reader import is_hf_dir
from checkpoint.names import LORA_FILE
from checkpoint.saves import clean_stale, read_tag
from data.collator import CausalLMCollator
from data.dataset import PlaceholderDataset, TokenizedDataset, cache_root
from data.packing import BlockDataset, PackedDataset, arranged
from data.sampling import TrainPlan
from models.config import check_preset, config_from_preset, load_hf_config
from models.lora import add_lora
from models.loss import CausalLMLoss
from models.partition import stage_bounds
from models.tensor_parallel import TensorParallel, parallelize_lora, vocab_parallel, vocab_parallel_cross_entropy
from models.tokenizer import check_tokenizer_fits, load_tokenizer
from training import checkpointing
from training.config import TrainConfig, evaluating, sequence_parallel, validate, validate_layout
from training.distributed import agreed, broadcast_object, init_distributed, rank0_works
from training.engine import build_module, describe_auto_precision, initialize_engine
from training.errors import RunError
from training.logs import configure_logging, log_to_file
from training.precision import resolve_precision
from training.run_dir import check_paths, prepare_output_dir, roll_back
from training.topology import Coords

log = logging.getLogger("trainer")


@dataclass
class Run:
    """Everything a built run holds; the loop (training/loop.py) drives it."""

    cfg: TrainConfig
    coords: Coords
    model_config: Any
    loss_fn: CausalLMLoss
    bounds: list[int]  # stage s holds pipeline layers bounds[s]..bounds[s + 1] - 1 (computed once)
    plan: TrainPlan | None = None  # set once the data is loaded
    total_steps: int = 0
    num_eval_rows: int = 0
    ephemeral_data: bool = False  # data.cache_dir="": the stores are removed after the run
    engine: Any = None
    step: int = 0
    data_state: dict = field(default_factory=dict)  # what decides the data order (checkpointing.DATA_KEYS)
    layout: dict = field(default_factory=dict)  # what a save records of this layout
    tokenizer: Any = None
    train_set: Any = None
    eval_set: Any = None
    collate: Any = None
    tp: TensorParallel = field(default_factory=TensorParallel)
    loaded_layers: list[int] = field(default_factory=list)
    lora_base: str | None = None

    def dp_group(self):
        return self.engine.grid.get_data_parallel_group()


def _user_error(e: Exception) -> RunError:
    return RunError(str(e))


def load_model_config(cfg: TrainConfig):
    """The model's transformers config: from `model_name_or_path` (checked against a preset named on the
    command line) or from the preset alone; attention implementation set. Raises RunError."""
    impl = str(cfg.model.attn_implementation)
    try:
        if cfg.model_name_or_path:
            path = os.path.join(cfg.model_name_or_path, "config.json")
            if not os.path.exists(path):
                raise RunError(f"model_name_or_path: {path} is missing (convert the model with convert2ckpt.py)")
            config = load_hf_config(cfg.model_name_or_path)
            check_preset(config, cfg.model, path)
        else:
            config = config_from_preset(cfg.model)
    except ValueError as e:
        raise _user_error(e) from None
    if impl == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise RunError(
                "model.attn_implementation=flash_attention_2 needs flash-attn (requirements-gpu.txt)"
            ) from None
    config._attn_implementation = impl
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if cfg.seq_length > config.max_position_embeddings and rope_type == "default":
        raise RunError(
            f"seq_length={cfg.seq_length} exceeds max_position_embeddings={config.max_position_embeddings} "
            "and the model configures no RoPE scaling"
        )
    return config


def _tokenizer(cfg: TrainConfig, vocab_size: int):
    path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    setting = "tokenizer_name_or_path" if cfg.tokenizer_name_or_path else "model_name_or_path"
    if path is None:
        raise RunError("tokenizer_name_or_path is not set")
    try:
        tokenizer = load_tokenizer(path, setting)
        check_tokenizer_fits(len(tokenizer), vocab_size, f"{setting} {path}")
    except ValueError as e:
        raise _user_error(e) from None
    return tokenizer


def _pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return candidate
    return 0


def _load_data(run: Run) -> None:
    """Tokenized datasets on the first and last stage, the row counts alone on middle stages, then the step plan.

    Rank 0 finds or builds the tokenized stores (data/store.py) while every other rank waits in short
    collectives (a long build never hits dist_timeout_minutes); the other data ranks then memory-map them.
    Packed rows or blocks (data.packing, data.concatenate) are arranged the same way on every data rank, and
    every rank learns the row counts from rank 0."""
    cfg, c, d = run.cfg, run.coords, run.cfg.data
    cache, run.ephemeral_data = cache_root(d.cache_dir, cfg.output_dir)

    def load(build: bool, beat=None) -> None:
        common = dict(cache_dir=cache, workers=d.tokenize_workers, concat=d.concatenate, build=build, beat=beat,
                      log=log.info)  # fmt: skip
        if cfg.do_train:
            run.train_set = TokenizedDataset(cfg.train_file, run.tokenizer, cfg.seq_length, d, d.train_weights,
                                             cfg.seed, **common)  # fmt: skip
        if evaluating(cfg):
            run.eval_set = TokenizedDataset(cfg.eval_file, run.tokenizer, cfg.seq_length, d, **common)

    rank0_works(lambda beat: load(True, beat), f"waiting for rank 0 to find or build the tokenized data in {cache}")
    counts = None
    with agreed():
        if c.has_data and c.rank != 0:
            load(build=False)
        if c.rank == 0:
            _log_rows(run)
        if c.has_data:
            if cfg.do_train:
                run.train_set = arranged(run.train_set, d.packing, d.concatenate, cfg.seq_length, train=True)
            if evaluating(cfg):
                run.eval_set = arranged(run.eval_set, d.packing, d.concatenate, cfg.seq_length, train=False)
        if c.rank == 0:
            counts = (len(run.train_set) if cfg.do_train else 0, len(run.eval_set) if evaluating(cfg) else 0)
    num_train_rows, run.num_eval_rows = broadcast_object(counts)
    what = "blocks" if d.concatenate else "packed rows" if d.packing else "rows"
    run.plan, run.total_steps = train_plan(cfg, c, num_train_rows, what)
    if not c.has_data:
        run.train_set = PlaceholderDataset(run.plan.num_rows)
        run.eval_set = PlaceholderDataset(run.num_eval_rows)


def _log_rows(run: Run) -> None:
    """Rank 0: where the rows come from, and rows that teach nothing."""
    cfg = run.cfg
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        if isinstance(ds, TokenizedDataset):
            how = "found" if ds.from_cache else "built"
            log.info("%s data: %d rows, tokenized store %s %s", name, len(ds), how, ", ".join(ds.store_dirs))
    if isinstance(run.train_set, TokenizedDataset):
        missing = run.train_set.report()["rows_without_targets"]
        if missing:
            first = (run.train_set.no_target_examples or ["?"])[0]
            log.warning("%s: %d of %d rows have no target token within seq_length=%d (first: %s)",
                        cfg.train_file, missing, len(run.train_set), cfg.seq_length, first)  # fmt: skip
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        report = ds.report() if isinstance(ds, TokenizedDataset) else {}
        if report.get("rows_with_lost_characters"):
            log.warning("%s data: %d rows hold characters the tokenizer drops or replaces by an unknown token "
                        "(first: %s); see data_report.json", name, report["rows_with_lost_characters"],
                        report["lost_character_examples"][0])  # fmt: skip


def train_plan(cfg: TrainConfig, coords: Coords, num_rows: int, what: str = "rows") -> tuple[TrainPlan, int]:
    """(the plan of which rows each step reads, total optimizer steps); RunError if the rows make no full step."""
    plan = TrainPlan(num_rows, coords.dp, cfg.micro_batch_size, cfg.gradient_accumulation_steps)
    if cfg.do_train and plan.steps_per_epoch == 0:
        raise RunError(f"train_file {cfg.train_file}: {num_rows} {what} give no full step of "
                       f"{plan.rows_per_step} rows per DP rank x {coords.dp} DP ranks")  # fmt: skip
    return plan, plan.total_steps(cfg.max_steps, cfg.num_train_epochs) if cfg.do_train else 0


def _data_state(run: Run) -> dict:
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
    }


def _weights_source(run: Run, plan: checkpointing.ResumePlan) -> str | None:
    """The step directory the stage's weights load from: the moved checkpoint itself (weights are layout-free),
    else model_name_or_path (converted first if it is a Hugging Face directory); LoRA resumes take the base."""
    cfg, c = run.cfg, run.coords
    if plan.moved and not cfg.lora.enabled:
        return os.path.join(cfg.output_dir, plan.tag)
    if not cfg.model_name_or_path or (plan.tag and not cfg.lora.enabled):
        return None
    path = cfg.model_name_or_path
    if is_hf_dir(path):
        from training.hf_source import convert_on_load

        path, reused = convert_on_load(path, cfg.output_dir, c, run.bounds)
        log.info("%s %s as %s", "reusing the conversion of" if reused else "converted", cfg.model_name_or_path, path)
    run.lora_base = os.path.abspath(path)
    with agreed():
        tag = read_tag(path)
    return os.path.join(path, tag)


def assemble(cfg: TrainConfig) -> Run:
    """Build this rank's part of the run described by `cfg`. Collective; raises RunError (same on every rank)."""
    rank, world = init_distributed(cfg.dist_timeout_minutes)
    coords = Coords(rank, world, cfg.num_stages, cfg.tensor_parallel_size, cfg.pipeline_schedule == "dualpipev")
    configure_logging(coords, cfg.log_all_ranks)
    with agreed():
        try:
            validate(cfg)
        except ValueError as e:
            raise _user_error(e) from None
        check_paths(cfg)
        if rank == 0:
            try:
                prepare_output_dir(cfg)
            except OSError as e:
                why = e.strerror or e
                raise RunError(f"output_dir {cfg.output_dir}: cannot move the earlier run aside ({why})") from None
    with agreed():
        try:
            os.makedirs(cfg.output_dir, exist_ok=True)
        except OSError as e:
            raise RunError(f"output_dir {cfg.output_dir}: cannot create ({e.strerror})") from None
        if not os.access(cfg.output_dir, os.W_OK):
            raise RunError(f"output_dir {cfg.output_dir}: not writable")
    checkpointing.seed_everything(cfg.seed)
    if rank == 0:
        for name in clean_stale(cfg.output_dir):
            log.warning("removed %s, left by an interrupted save", os.path.join(cfg.output_dir, name))
        if cfg.deepspeed.precision == "auto":
            log.info(describe_auto_precision(resolve_precision("auto")))
    log_to_file(cfg.output_dir, rank)
    with agreed():
        model_config = load_model_config(cfg)
        try:
            validate_layout(cfg, world, model_config)
            stages = 2 * cfg.num_stages if cfg.pipeline_schedule == "dualpipev" else cfg.num_stages
            bounds = stage_bounds(model_config, stages, cfg.model.partition)  # once per run
        except ValueError as e:
            raise _user_error(e) from None
    tp = TensorParallel(cfg.tensor_parallel_size, coords.tp_rank, cfg.model.vocab_pad_multiple,
                        sequence_parallel=sequence_parallel(cfg))  # fmt: skip
    cross_entropy = None
    if vocab_parallel(model_config, tp):  # no rank holds [B, S, V] logits; padded rows never reach the loss
        cross_entropy = functools.partial(vocab_parallel_cross_entropy, tp=tp, vocab_size=model_config.vocab_size)
    loss_fn = CausalLMLoss(cross_entropy, cfg.model.loss_chunk_size)
    run = Run(cfg, coords, model_config, loss_fn, bounds, tp=tp)
    run.layout = checkpointing.saved_layout(cfg, coords, model_config, bounds)
    resume = checkpointing.plan_resume(cfg, coords, run.layout)  # before slow work: a bad resume fails now
    with agreed():
        if coords.has_data:
            run.tokenizer = _tokenizer(cfg, model_config.vocab_size)
    _load_data(run)
    run.collate = CausalLMCollator(cfg.seq_length, _pad_id(run.tokenizer), cfg.data.documents_share_rows)
    run.data_state = _data_state(run)

    source = _weights_source(run, resume)
    module = build_module(cfg, coords, model_config, run.loss_fn, tp, bounds,
                          skip_init=cfg.model_name_or_path is not None)  # fmt: skip
    with agreed():
        if source:
            run.loaded_layers = checkpointing.load_stage_weights(module, source, model_config, tp)
    module._synchronize_tied_weights()
    if source:
        log.info("loaded %s: rank %d read %d layer files", source, rank, len(run.loaded_layers))
    if cfg.lora.enabled:
        lo = cfg.lora
        trainable = add_lora(module, lo.r, lo.alpha, lo.dropout, lo.target_modules, cfg.seed, tp.rank, tp.size)
        parallelize_lora(module, tp)
        log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters on rank %d", lo.r, lo.alpha,
                 lo.target_modules, trainable, rank)  # fmt: skip
        with agreed():
            if resume.moved:  # the adapter, saved per global layer like the weights
                adapter = os.path.join(cfg.output_dir, resume.tag)
                checkpointing.load_stage_weights(module, adapter, model_config, tp, trainable_only=True)
    run.engine = initialize_engine(cfg, coords, module, max(run.total_steps, 1),
                                   load_universal=bool(resume.universal_tag))  # fmt: skip
    if resume.tag:
        run.step = checkpointing.resume(run.engine, cfg, resume, run.data_state, model_config, tp,
                                        max(run.total_steps, 1))  # fmt: skip
        with agreed():
            checkpointing.restore_rng(cfg, coords, resume)
            if cfg.resume_from and rank == 0:  # only once the resume is known to work: newer steps move aside
                roll_back(cfg.output_dir, cfg.resume_from)
        log.info("resumed from %s at step %d", os.path.join(cfg.output_dir, resume.tag), run.step)
    if rank == 0:
        write_run_files(run)
    dist.barrier()
    return run


def write_run_files(run: Run) -> None:
    """Resolved config, model config, tokenizer and data report, so output_dir is itself a loadable model dir."""
    import json
    import shutil

    from omegaconf import OmegaConf

    cfg = run.cfg
    if cfg.lora.enabled:  # what `convert2ckpt.py --to-hf --merge-lora` needs
        lo = cfg.lora
        info = {"r": lo.r, "alpha": lo.alpha, "target_modules": list(lo.target_modules), "base": run.lora_base}
        with open(os.path.join(cfg.output_dir, LORA_FILE), "w") as f:
            json.dump(info, f, indent=2)
    with open(os.path.join(cfg.output_dir, "train_config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    run.model_config.save_pretrained(cfg.output_dir)
    if run.tokenizer is not None:
        run.tokenizer.save_pretrained(cfg.output_dir)
    source = cfg.model_name_or_path
    target = os.path.join(cfg.output_dir, "generation_config.json")
    generation = os.path.join(source, "generation_config.json") if source else ""
    if generation and os.path.exists(generation) and not os.path.exists(target):
        shutil.copy2(generation, target)
    report = {}
    for name, ds in (("train", run.train_set), ("eval", run.eval_set)):
        if isinstance(ds, (TokenizedDataset, PackedDataset, BlockDataset)):
            report[name] = r = ds.report()
            log.info("%s data %s: %d rows, %d tokens, %.1f%% of them targets, %d rows truncated to %d tokens, "
                     "%d rows without targets", name, r["file"], r["rows"], r["tokens"], 100 * r["target_share"],
                     r["truncated_rows"], cfg.seq_length, r["rows_without_targets"])  # fmt: skip
            if "packed_rows" in r:
                log.info("%s data packed: %d rows in %d rows of %d tokens (%.2f per row), padding %.1f%% -> %.1f%%",
                         name, r["rows"], r["packed_rows"], cfg.seq_length, r["rows_per_packed_row"],
                         100 * r["padding_share_unpacked"], 100 * r["padding_share_packed"])  # fmt: skip
            if "blocks" in r:
                log.info("%s data concatenated: %d documents in %d blocks of %d tokens, %d tokens of a partial block "
                         "dropped", name, r["rows"], r["blocks"], cfg.seq_length, r["tokens_dropped"])  # fmt: skip
    if report:
        with open(os.path.join(cfg.output_dir, "data_report.json"), "w") as f:
            json.dump(report, f, indent=2)
