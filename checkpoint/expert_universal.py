"""DeepSpeed's universal checkpoint for a model with experts saved by DeepSpeed's optimizers (bf16, ZeRO-1).

    python -m checkpoint.expert_universal --input_folder RUN/global_stepN --output_folder OUT

DeepSpeed's converter (`deepspeed.checkpoint.ds_to_universal`) concatenates every DP rank's fragments of a
parameter. Experts split over E ranks (training/expert_parallel.py) are different tensors on each EP rank: the DP
ranks `r, r + E, r + 2E, ...` of a stage hold EP rank r's experts, sharded among themselves. So this runs DeepSpeed's
own steps for every other parameter and assembles the fused experts here (their biases too: gpt-oss): per saved TP
rank, each EP rank's fragments in DP order, the EP ranks along dim 0; then the TP shards merged by our rule
(models/sharding.py). Each expert state is saved whole ([E, ...]) with what DeepSpeed's loader needs to take a
rank's share in any layout: its experts (EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS: dim 0 narrowed by the new EP rank), then
its TP shard (CAT_DIM and PARAM_N_SUB_PARAMS: gate and up halves split apart), then its DP fragment
(deepspeed/checkpoint/universal_checkpoint.py `load_hp_checkpoint_state`). Without experts split (E = 1) the same
holds with one EP rank: fused experts then also move between TP degrees, which DeepSpeed's default (dim 0) could not.
A Muon run's momentum (layout.json "optimizer": "muon") is read as Adam's first moment, experts' included, and named
back (checkpoint/muon_universal.py).

Run as a subprocess by checkpoint/universal.py `ensure_universal`, as DeepSpeed's converter is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil

import torch

from checkpoint.muon_universal import momentum_as_first_moment, momentum_named_back
from checkpoint.names import LAYOUT_FILE
from models.sharding import EXPERT_IN, EXPERT_ROW, GATE_UP, GATE_UP_OUT, REPLICA, merge
from models.tp_rules import param_tp_split

# rule: (CAT_DIM, halves). REPLICA: a fused experts tensor every TP rank holds whole (gpt-oss's expert biases).
EXPERT_RULES = {GATE_UP: (1, 2), EXPERT_ROW: (2, 1), GATE_UP_OUT: (2, 2), EXPERT_IN: (1, 1), REPLICA: (0, 1)}
_FUSED_EXPERTS = re.compile(r"\d+\..+\.experts\.[a-z_]+")  # transformers' fused experts: [E, ...], E split over EP
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def expert_names(names, num_hidden_layers: int, tie_word_embeddings: bool, config=None) -> dict[str, str]:
    """{parameter name: TP rule} of the fused expert parameters among `names` (the optimizer's)."""
    rules = {n: param_tp_split(n, num_hidden_layers, tie_word_embeddings, config) for n in names}
    return {n: r for n, r in rules.items() if is_expert(n, r)}


def is_expert(name: str, rule: str) -> bool:
    """Whether the optimizer's parameter `name` (TP rule `rule`) is a fused experts tensor assembled here."""
    return rule in EXPERT_RULES and (rule != REPLICA or _FUSED_EXPERTS.fullmatch(name) is not None)


def _fragments(temp: str, name: str, tp: int, state: str, dps) -> list:
    """The fragments of `name` that DP ranks `dps` hold, in their order: ZeRO cuts a group's flat buffer into equal
    partitions, so a parameter may lie in some of them only."""
    paths = [os.path.join(temp, name, str(tp), f"{state}.{d:02d}") for d in dps]
    return [torch.load(p, map_location="cpu", weights_only=True) for p in paths if os.path.exists(p)]


def assemble(temp: str, name: str, rule: str, shapes: list, dp: int, ep: int, num_experts: int, out_dir: str) -> None:
    """Write `out_dir/zero/name/{fp32,exp_avg,exp_avg_sq,step}.pt` of one fused expert parameter from DeepSpeed's
    extracted fragments in `temp` (`temp/name/TP/state.DP`); `shapes`: its saved shape per TP rank ([E / ep, ...])."""
    from deepspeed.checkpoint.constants import CAT_DIM, EP_IS_EXPERT_PARAM, EP_NUM_EXPERTS, PARAM, PARAM_N_SUB_PARAMS

    cat_dim, halves = EXPERT_RULES[rule]
    target = os.path.join(out_dir, "zero", name)
    os.makedirs(target, exist_ok=True)
    for state in STATES:
        tp_shards = []
        for tp, shape in enumerate(shapes):
            local = [
                torch.cat([f.flatten() for f in _fragments(temp, name, tp, state, range(r, dp, ep))]).view(shape)
                for r in range(ep)
            ]
            tp_shards.append(torch.cat(local))  # [E, ...] of this TP rank
        whole = merge(tp_shards, rule)
        if whole.shape[0] != num_experts:
            raise ValueError(f"{name}: assembled {whole.shape[0]} experts, the model has {num_experts}")
        saved = {PARAM: whole, CAT_DIM: cat_dim, EP_IS_EXPERT_PARAM: True, EP_NUM_EXPERTS: num_experts}
        if halves > 1:
            saved[PARAM_N_SUB_PARAMS] = halves
        torch.save(saved, os.path.join(target, f"{state}.pt"))
    steps = _fragments(temp, name, 0, "step", range(dp))
    if not steps:  # a state without a step count (Muon's momentum), as DeepSpeed's own merge leaves it
        return
    if len({float(s) for s in steps}) != 1:
        raise ValueError(f"{name}: the DP ranks' optimizer steps differ ({sorted(float(s) for s in steps)})")
    torch.save(steps[0], os.path.join(target, "step.pt"))


def convert(
    input_folder: str, output_folder: str, ep: int, num_experts: int, layers: int, tied: bool, config=None
) -> list[str]:
    """DeepSpeed's ZeRO-1/2 branch of `ds_to_universal.main`, with the fused experts assembled here. Returns their
    names."""
    from deepspeed.checkpoint import ds_to_universal as dsu
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint

    args = argparse.Namespace(
        input_folder=input_folder,
        output_folder=output_folder,
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds = DeepSpeedCheckpoint(input_folder)
    dsu._inject_missing_state(ds)
    dsu._check_for_required_state(ds)
    slice_shapes_by_tp, _, _ = dsu._aggregate_autoep_zero12_metadata(ds.model_state_metadata)
    slice_shapes = dsu._group_per_tp_shapes(slice_shapes_by_tp, ds.pp_degree, ds.tp_degree)
    experts = expert_names(slice_shapes, layers, tied, config)
    if ds.dp_degree % ep:
        raise ValueError(f"expert_parallel_size {ep} does not divide the saved data ranks {ds.dp_degree}")
    temp = os.path.join(output_folder, "tmp")
    dsu._extract_zero_shard_files(args, ds, temp)
    info = ds.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    for key, value in info.items():  # the experts are assembled here, not merged by DeepSpeed (saves made before
        # universal_info left them out declared gpt-oss's expert biases averaged: their patterns go)
        if isinstance(value, list) and all(isinstance(p, str) for p in value):
            info[key] = [p for p in value if not any(re.fullmatch(p, name) for name in experts)]
    dsu._merge_tp_slice_files(args, info, ds.tp_degree, slice_shapes, temp, exclude_param_names=set(experts))
    for name, rule in sorted(experts.items()):
        assemble(temp, name, rule, slice_shapes[name], ds.dp_degree, ep, num_experts, output_folder)
    dsu._save_optimizer_state(args, ds)
    shutil.rmtree(temp, ignore_errors=True)
    for f in ds.mp_rank_files:
        shutil.copy2(f, output_folder)
    return sorted(experts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input_folder", required=True, help="a checkpoint's tag directory (layout.json beside)")
    p.add_argument("--output_folder", required=True)
    args = p.parse_args(argv)
    from transformers import AutoConfig

    from models.moe import num_experts

    with open(os.path.join(args.input_folder, LAYOUT_FILE)) as f:
        layout = json.load(f)
    config = AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(args.input_folder)))
    muon = layout.get("optimizer") == "muon"
    with momentum_as_first_moment() if muon else contextlib.nullcontext(set()) as momentum:
        names = convert(
            args.input_folder,
            args.output_folder,
            layout.get("expert_parallel_size", 1),
            num_experts(config),
            config.num_hidden_layers,
            bool(config.tie_word_embeddings),
            config,
        )
    momentum_named_back(args.output_folder, momentum)
    print(f"universal checkpoint with {len(names)} fused expert parameters assembled: {args.output_folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
