"""Training checkpoints: what a run loads at start, saving, and resuming (in the same or another layout).

- Start: weights come from layer files named by global layer index (layout-free), each rank reading
  only its own stage's files (`load_stage_weights`).
- Save: training/saving.py (snapshot, background write, commit; crash-safe by checkpoint/saves.py).
- Resume in the same layout: DeepSpeed's `load_checkpoint`, plus per-rank RNG states.
- Resume in another PP x TP x DP layout: ZeRO-1 state through DeepSpeed's universal checkpoint (converted
  once by rank 0), ZeRO-0 state reshaped by parameter name (checkpoint/optimizer_reshape.py).
- Every checkpoint records what decides the data order (`data` in the engine's client state); a resume
  whose data, seed or global batch differ is refused, naming what changed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

from checkpoint.errors import CheckpointError
from checkpoint.layer_files import layer_files_as_plain_data
from checkpoint.names import rng_file
from checkpoint.optimizer_reshape import gather_moved_state, load_moved_state, optimizer_param_names
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.safe_load import load_pt
from checkpoint.saves import choose_checkpoint
from checkpoint.universal import (
    LAYOUT_DEFAULTS,
    check_movable,
    ensure_universal,
    layout_changed,
    read_layout,
)
from models.moe import is_moe
from models.partition import rank_layers
from models.pipe_layout import pipe_layers
from models.tensor_parallel import TensorParallel
from models.tp_rules import param_tp_split
from schema.train import TrainConfig, resume_mode, sequence_parallel
from training.distributed import agreed, broadcast_object
from training.engine import follow_new_schedule
from training.errors import RunError
from training.expert_parallel import (
    checkpoint_files_as_ours,
    deepspeed_owns_experts,
    keep_own_experts,
    universal_load_by_name,
)
from training.run_dir import check_own_checkpoint, check_resume_from
from training.topology import Coords

log = logging.getLogger("trainer")

# What decides which rows each step reads, in the order a mismatch is reported (see `check_data_state`).
DATA_KEYS = (
    "objective",
    "seed",
    "global_batch_size",
    "seq_length",
    "train_weights",
    "packing",
    "concatenate",
    "num_train_rows",
    "train_data_fingerprint",
)


@dataclass
class ResumePlan:
    """How this run resumes: from `tag` in output_dir (None: start fresh), and how its optimizer state moves."""

    tag: str | None = None
    universal_tag: str | None = None  # ZeRO-1 state through DeepSpeed's universal checkpoint (layout changed)
    reshape: bool = False  # ZeRO-0 state reshaped by parameter name (layout changed)

    @property
    def moved(self) -> bool:
        return bool(self.universal_tag or self.reshape)


def saved_layout(cfg: TrainConfig, coords: Coords, model_config, bounds: list[int]) -> dict:
    """What a checkpoint records about the PP x TP x DP layout that saved it (checkpoint/universal.py)."""
    return {
        "num_stages": cfg.num_stages,
        "tp_size": coords.tp,
        "dp_size": coords.dp,
        "vocab_pad_multiple": cfg.model.vocab_pad_multiple,
        "stage_bounds": list(bounds),  # 2 x num_stages + 1 entries with DualPipeV
        "pipeline_schedule": str(cfg.pipeline_schedule),
        "sequence_parallel": sequence_parallel(cfg),  # no effect on what is saved: any run may resume it
        "rank_layers": rank_layers(bounds, cfg.num_stages),  # the pipeline layers each pipeline rank holds
        "global_batch_size": coords.global_batch(cfg.micro_batch_size, cfg.gradient_accumulation_steps),
        "num_hidden_layers": model_config.num_hidden_layers,
        "precision": str(cfg.deepspeed.precision),  # resolved once (training/precision.py)
        "zero_stage": cfg.deepspeed.zero_stage,
        "expert_parallel_size": cfg.expert_parallel_size,
        "context_parallel_size": cfg.context_parallel_size,
        "optimizer": str(cfg.optim.name),  # Muon's state does not carry over to AdamW, nor back
    }


def find_resume_tag(cfg: TrainConfig) -> str | None:
    """resume_from: that complete checkpoint; resume=true: the newest complete one, or an error; auto: it or None.
    When the checkpoint taken is not the one `latest` names, one log line says which and why."""
    if cfg.resume_from:
        check_resume_from(cfg.output_dir, cfg.resume_from)
        return cfg.resume_from
    mode = resume_mode(cfg)
    if mode == "false":
        return None
    tag, why = choose_checkpoint(cfg.output_dir)
    if why:
        log.warning("resume: %s; loading %s", why, tag or "nothing")
    if tag is None and mode == "true":
        raise RunError(
            f"resume=true but output_dir {cfg.output_dir} holds no checkpoint (use resume=auto to start fresh)"
        )
    if tag is None:
        log.info("resume=auto: no checkpoint in %s, starting fresh", cfg.output_dir)
    else:
        check_own_checkpoint(os.path.join(cfg.output_dir, tag), f"resume from {tag}")
    return tag


def plan_resume(cfg: TrainConfig, coords: Coords, current: dict, experts: bool = False) -> ResumePlan:
    """Collective. Find the checkpoint to resume; if it was saved in another layout, choose how its optimizer
    state moves (and, for ZeRO-1, have rank 0 convert it to a universal checkpoint once). `current`: this run's
    layout record (`saved_layout`); `experts`: the model has experts."""
    plan = ResumePlan()
    with agreed():
        plan.tag = find_resume_tag(cfg)
        saved = read_layout(os.path.join(cfg.output_dir, plan.tag)) if plan.tag else None
        if saved is not None and saved.get("optimizer", "adamw") != current["optimizer"]:
            raise CheckpointError(
                f"{os.path.join(cfg.output_dir, plan.tag)}: saved with optim.name={saved.get('optimizer', 'adamw')}, "
                f"this run has optim.name={current['optimizer']}: the optimizer state does not carry over (resume "
                "with the saved optim.name, or start a new run from its weights: model_name_or_path=<that checkpoint>)"
            )
        moved = layout_changed(saved, current) or (saved is not None and experts_resharded(saved, current))
        if moved:
            where = os.path.join(cfg.output_dir, plan.tag)
            check_movable(saved, current, where)
            plan.reshape = saved.get("zero_stage", 0) == 0
            if not plan.reshape and cfg.lora.enabled:
                raise CheckpointError(
                    f"{where}: a LoRA run saved with ZeRO-1 cannot move to another layout (DeepSpeed's universal "
                    "checkpoint does not handle frozen weights); train LoRA with deepspeed=fp32 to move it, or "
                    "resume it as saved"
                )
    if plan.tag and moved:
        universal = None
        with agreed():
            if not plan.reshape and coords.rank == 0:
                universal = ensure_universal(cfg.output_dir, plan.tag, experts)
        plan.universal_tag = broadcast_object(universal)
        how = "optimizer state reshaped by parameter name" if plan.reshape else plan.universal_tag
        was_ep, now_ep = saved.get("expert_parallel_size", 1), current["expert_parallel_size"]
        log.info(
            "resuming %s saved with PP=%d x TP=%d x DP=%d in PP=%d x TP=%d x DP=%d%s (%s)",
            os.path.join(cfg.output_dir, plan.tag),
            saved["num_stages"],
            saved.get("tp_size", 1),
            saved["dp_size"],
            current["num_stages"],
            current["tp_size"],
            current["dp_size"],
            f", expert_parallel_size {was_ep} -> {now_ep}" if was_ep != now_ep else "",
            how,
        )
    return plan


def experts_resharded(saved: dict, current: dict) -> bool:
    """Whether a change of expert_parallel_size alone moves the optimizer state: under DeepSpeed's optimizers (bf16,
    ZeRO-1) each rank saves its shard of its own experts' state (training/expert_parallel.py), so another E reads
    it through a universal checkpoint (checkpoint/expert_universal.py). fp32 ZeRO-0 saves every expert whole."""
    was = saved.get("expert_parallel_size", LAYOUT_DEFAULTS["expert_parallel_size"])
    now = current["expert_parallel_size"]
    sharded = (was > 1 and deepspeed_owns_experts(saved["precision"], saved.get("zero_stage", 0))) or (
        now > 1 and deepspeed_owns_experts(current["precision"], current["zero_stage"])
    )
    return sharded and was != now


def load_stage_weights(module, step_dir: str, config, tp: TensorParallel, trainable_only: bool = False) -> list[int]:
    """Load this stage's layers (this TP rank's shard of each) from `step_dir`. Returns the layer indices loaded.

    Every parameter must be in the files, or with `trainable_only` (a LoRA checkpoint, which holds
    the adapter only) every trainable one; a key the model lacks is an error either way. Only this
    stage's layers are opened, memory-mapped and as plain tensor data (checkpoint/safe_load.py): its own
    TP rank's file when the checkpoint has this TP degree, else every shard of the layer, merged and split
    again (checkpoint/layer_files.py). Tied weights are synchronised by the caller.

    NOTE: DeepSpeed's `load_state_dir` reads every layer file twice (once to check its metadata), which
    doubles start-up I/O on large models, and cannot change the TP degree of HF-named weights.

    Raises:
        CheckpointError: a missing, unsafe or mismatched file, named.
    """
    ckpt = PipelineCheckpoint.at(step_dir, config)  # engine files scanned: one that is unsafe means tampering
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    loaded = []
    held = []  # (pipeline layer, its module) of every phase this rank runs (DualPipeV's ranks hold two stages)
    for phase in module.phases():
        module.activate_phase(phase)
        held += [(layers[module._local_start + i], m) for i, m in enumerate(module.forward_funcs)]
    module.activate_phase(0)
    for layer, layer_module in held:
        if not hasattr(layer_module, "load_state_dict"):  # the tied LM head: a function of layer 0's module
            continue
        state = ckpt.load_shard(layer, tp.rank, tp.size, tp.vocab_multiple)
        where = ckpt.layer_file(layer.index)
        try:
            missing, unexpected = layer_module.load_state_dict(state, strict=not trainable_only)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise CheckpointError(f"{where}: does not fit this model ({' '.join(first[:2])[:300]})") from None
        trainable = {n for n, p in layer_module.named_parameters() if p.requires_grad}
        if unexpected or trainable & set(missing):
            bad = f"unexpected {unexpected[0]}" if unexpected else f"missing {sorted(trainable & set(missing))[0]}"
            raise CheckpointError(f"{where}: does not fit this model ({bad})")
        loaded.append(layer.index)
    return loaded


def check_data_state(saved: dict, now: dict, tag: str) -> None:
    """Refuse a resume whose data order would differ, naming what changed (keys missing from older saves pass)."""
    if "train_rows_sha256" in saved and "train_data_fingerprint" not in saved and saved.get("train_weights"):
        raise RunError(
            f"resume: the checkpoint {tag} was saved before the tokenized store, whose mixture of "
            "weighted train files draws rows differently: the data order would not continue"
        )
    for key in DATA_KEYS:
        if key not in saved or saved[key] == now.get(key):
            continue
        if key == "train_data_fingerprint":
            raise RunError(
                f"resume: the tokenized training rows differ from those the checkpoint {tag} was saved with "
                "(train_file contents, tokenizer or data settings changed), so the data order would not continue"
            )
        raise RunError(f"resume: {key}={now.get(key)} but the checkpoint {tag} was saved with {saved[key]}")


def resume(
    engine, cfg: TrainConfig, plan: ResumePlan, data_state: dict, config, tp: TensorParallel, total_steps: int
) -> int:
    """Load `plan.tag` into `engine` (weights, optimizer, step) and check its data; the LR schedule then follows
    this run's settings (`total_steps`, warmup, kind, ratios, learning rate) from the restored step. Returns
    the step."""
    step_dir = os.path.join(cfg.output_dir, plan.tag)
    if plan.reshape:
        client = _load_reshaped(engine, step_dir, config, tp)
    else:
        # Experts' groups, and Muon's beside AdamW's, differ between the stages of two layouts: loaded by name.
        groups_differ = is_moe(config) or cfg.optim.name == "muon"
        by_name = universal_load_by_name(engine) if plan.universal_tag and groups_differ else contextlib.nullcontext()
        with checkpoint_files_as_ours(engine), layer_files_as_plain_data(engine.checkpoint_engine), by_name:
            path, client = engine.load_checkpoint(
                cfg.output_dir, tag=plan.universal_tag or plan.tag, load_module_strict=not cfg.lora.enabled
            )
        if path is None:
            raise RunError(f"{step_dir}: checkpoint could not be loaded")
    if engine.module._ep.size > 1:  # the saved Adam moments hold every expert: keep this rank's
        keep_own_experts(engine, engine.module._ep)
    check_data_state(client.get("data", {}), data_state, plan.tag)
    changes = follow_new_schedule(engine.lr_scheduler, cfg, total_steps)
    if changes:
        log.info(
            "resume: the LR schedule follows this run's settings from step %d on (%s)",
            engine.global_steps,
            "; ".join(changes),
        )
    return engine.global_steps


def restore_rng(cfg: TrainConfig, coords: Coords, plan: ResumePlan) -> None:
    """This rank's RNG states from the resumed checkpoint (same layout only: a new layout has other ranks)."""
    path = os.path.join(cfg.output_dir, plan.tag, rng_file(coords.rank))
    if plan.moved:
        log.info("layout changed: per-rank RNG states not restored (dropout masks differ from an unmoved run)")
    elif os.path.exists(path):
        restore_rng_state(path)
    else:
        log.warning("%s: missing, RNG states not restored", path)


def _load_reshaped(engine, step_dir: str, config, tp: TensorParallel) -> dict:
    """ZeRO-0 optimizer state, LR schedule and step counters of this stage's parameters, by name."""
    names = optimizer_param_names(engine.module, engine.optimizer)
    if names is None:
        raise RunError(f"{step_dir}: ZeRO-0 optimizer state moves into a ZeRO-0 fp32 run only (deepspeed=fp32)")

    def rule_of(name: str) -> str:
        return param_tp_split(name, config.num_hidden_layers, config.tie_word_embeddings, config)

    moved = gather_moved_state(
        step_dir,
        read_layout(step_dir),
        {n for g in names for n in g},
        rule_of,
        tp.rank,
        tp.size,
        config.vocab_size,
        tp.vocab_multiple,
    )
    load_moved_state(engine, names, moved)
    return moved.client_state


def rng_state() -> dict:
    """This rank's random generators (python, numpy, torch, CUDA): dropout masks after a resume match."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(path: str) -> None:
    state = load_pt(path)  # plain data only (the numpy state is an array): checkpoint/safe_load.py
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
