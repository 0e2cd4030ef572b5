"""Moving whole-per-stage (ZeRO-0) optimizer state to another PP x TP x DP layout, by parameter name.

DeepSpeed's universal-checkpoint tool reads ZeRO shards only, so the fp32 preset (ZeRO-0, a plain
torch AdamW per stage, saved whole in `mp_rank_XX_model_states.pt`) is reshaped here. Every save
records, next to the optimizer state, the name of each parameter in each optimizer group
(`OPTIMIZER_NAMES`). Names are the pipeline module's own (`3.self_attn.q_proj.weight`,
`tied_modules.embed.weight`), keyed by global layer index, so they do not depend on the layout:
a stage of the new layout takes the Adam moments of its parameters from whichever old stage held
them (a tied weight lives on two stages with identical state; the first is used). Across a change of
tensor-parallel degree the moments of each parameter are merged from every old TP rank and split for
the new one by the parameter's own rule (models/sharding.py). Only the new stage's own parameters are
kept in memory, old engine files are memory-mapped.

LoRA runs move the same way: their optimizer holds the adapter parameters only. Muon's momentum (optim.name=muon)
moves as the Adam moments do, by each matrix's rule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from checkpoint.errors import CheckpointError
from checkpoint.names import engine_file
from checkpoint.safe_load import load_pt
from models.sharding import merge, shard

OPTIMIZER_NAMES = "optimizer_param_names"


def optimizer_param_names(module, optimizer) -> list[list[str]] | None:
    """Names of the parameters in each group of `optimizer`, or None if it holds copies (bf16/ZeRO)."""
    names = {id(p): n for n, p in module.named_parameters()}
    groups = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    return None if any(n is None for g in groups for n in g) else groups


def group_key(group: dict) -> tuple:
    """What pairs a saved optimizer group with a new one: its weight decay, and whether Muon steps it."""
    return group["weight_decay"], bool(group.get("muon", False))


@dataclass
class MovedState:
    """What a new stage takes over from a checkpoint saved in another layout."""

    param_state: dict[str, dict[str, torch.Tensor]]  # name -> Adam state ({} if never stepped)
    group_options: dict[tuple, dict]  # `group_key` -> group hyperparameters (lr, betas, ...)
    lr_scheduler: dict | None
    counters: dict  # global_steps, global_samples, skipped_steps
    client_state: dict


def gather_moved_state(
    step_dir: str,
    saved_layout: dict,
    wanted: set[str],
    rule_of,
    tp_rank: int = 0,
    tp_size: int = 1,
    vocab_size: int | None = None,
    vocab_multiple: int = 1,
) -> MovedState:
    """Collect the optimizer state of the parameters named in `wanted` from the saved engine files, as this
    tensor-parallel rank's shard.

    Args:
        step_dir: the checkpoint.
        saved_layout: its `layout.json` (stages and TP degree that wrote it).
        wanted: this new stage's parameter names.
        rule_of: name -> how it splits across TP ranks (models.tp_rules.param_tp_split).
        tp_rank, tp_size, vocab_size, vocab_multiple: where the state goes (models/sharding.py).
    """
    stages, saved_tp = saved_layout["num_stages"], saved_layout.get("tp_size", 1)
    shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}  # name -> saved TP rank -> Adam state
    group_options: dict[float, dict] = {}
    first = None
    for stage in range(stages):
        for old_tp in range(saved_tp):
            path = os.path.join(step_dir, engine_file(stage * saved_tp + old_tp))
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing; the checkpoint was saved with {stages} stages x TP {saved_tp}")
            saved = load_pt(path, mmap=True)
            names, optim = saved.get(OPTIMIZER_NAMES), saved.get("optimizer")
            if names is None or optim is None:
                raise CheckpointError(f"{path}: no parameter names recorded with its optimizer state; cannot move it")
            first = first or saved
            for group, group_names in zip(optim["param_groups"], names, strict=True):
                group_options.setdefault(group_key(group), {k: v for k, v in group.items() if k != "params"})
                for index, name in zip(group["params"], group_names, strict=True):
                    held = shards.setdefault(name, {})
                    if name in wanted and old_tp not in held:  # a tied weight: the first stage's copy
                        held[old_tp] = dict(optim["state"].get(index, {}))
            del saved, optim
    missing = sorted(n for n in wanted if len(shards.get(n, {})) != saved_tp)
    if missing:
        raise CheckpointError(
            f"{step_dir}: no optimizer state for {len(missing)} parameters of this stage (first: {missing[0]}); "
            "was it saved from another model or another LoRA configuration?"
        )
    found = {}
    for name in wanted:
        parts = [shards[name][t] for t in range(saved_tp)]
        rule, state = rule_of(name), {}
        for key, value in parts[0].items():  # exp_avg, exp_avg_sq: shaped like the parameter; step: a scalar
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                whole = merge([p[key] for p in parts], rule, vocab_size)
                value = shard(whole, rule, tp_rank, tp_size, vocab_size, vocab_multiple)
            state[key] = value.clone() if isinstance(value, torch.Tensor) else value  # off the memory map
        found[name] = state
    counters = {k: first[k] for k in ("global_steps", "global_samples", "skipped_steps") if k in first}
    client = {k: v for k, v in first.items() if k == "data"}
    return MovedState(found, group_options, first.get("lr_scheduler"), counters, client)


def load_moved_state(engine, names: list[list[str]], moved: MovedState) -> None:
    """Put `moved` into `engine` (a ZeRO-0 fp32 DeepSpeed engine whose optimizer groups are named `names`)."""
    optimizer = engine.optimizer
    state = optimizer.state_dict()
    new_state, index = {}, 0
    for group, group_names in zip(state["param_groups"], names, strict=True):
        options = moved.group_options.get(group_key(group))
        if options is None:
            muon = "Muon's" if group.get("muon") else "AdamW's"
            raise CheckpointError(
                f"no optimizer group of {muon} with weight_decay={group['weight_decay']} in the checkpoint "
                "(saved with another optim.name?)"
            )
        group.update({k: v for k, v in options.items() if k in group})
        for name in group_names:
            if moved.param_state[name]:
                new_state[index] = moved.param_state[name]
            index += 1
    state["state"] = new_state
    optimizer.load_state_dict(state)
    if moved.lr_scheduler is not None and engine.lr_scheduler is not None:
        schedule, groups = dict(moved.lr_scheduler), len(engine.optimizer.param_groups)
        for key in ("lr_lambdas", "base_lrs", "_last_lr"):  # one schedule for every group (training/engine.py)
            if isinstance(schedule.get(key), list) and schedule[key] and len(schedule[key]) != groups:
                schedule[key] = schedule[key][:1] * groups  # a stage with more or fewer groups than the saving one
        engine.lr_scheduler.load_state_dict(schedule)
    for key, value in moved.counters.items():
        setattr(engine, key, value)
