"""Expert parallelism in the DeepSpeed engine: the expert gradients' own reduction, the global norm counting every
expert once, and checkpoints that hold every expert whatever the EP degree (models/expert_parallel.py splits the
experts; this module does what the engine must do about it).

- Gradients. An expert's gradient already sums the tokens its EP group routed to it (the all-to-all's backward);
  the DP / E ranks holding the same experts add theirs (`ep.data_group`) and divide by the DP size, as DeepSpeed
  averages everything else over DP.
- Clipping. The global norm adds the non-expert gradients once (DeepSpeed's model-parallel rule) and the experts
  of every rank of the EP group once.
- Checkpoints. Layer files hold every expert (each sparse layer's gathered over the EP group as DeepSpeed writes
  that layer: `every_expert`); at load each rank keeps its experts' slices.

Two owners of the reduction, chosen by the optimizer (`deepspeed_owns_experts`):

- fp32 with ZeRO-0 (DeepSpeed's basic optimizer: our AdamW itself): `attach` reduces the experts and clips, and
  the optimizer state DeepSpeed's DP rank 0 saves holds every expert's Adam moments (gathered likewise), so a run
  resumes with any EP degree.
- bf16, and ZeRO-1 (DeepSpeed's optimizers flatten parameters per group, and ZeRO-1 shards each group over DP):
  `register` hands our groups to DeepSpeed's own MoE bookkeeping (`deepspeed.utils.groups`, parameters marked as
  its MoE layers mark them, groups of their own in the optimizer), which reduces the experts over the expert-data
  group dividing by DP, shards their optimizer state over those DP / E ranks, broadcasts them within it at start-up
  and counts them once in the norm. Each rank saves its own shard; a resume with another E, PP, TP or DP goes
  through DeepSpeed's universal format (checkpoint/expert_universal.py, `universal_load_by_name`).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE

from models.expert_parallel import ExpertParallel
from training.muon import steps_each_parameter


def deepspeed_owns_experts(precision: str, zero_stage: int) -> bool:
    """Whether DeepSpeed's MoE bookkeeping reduces, shards and clips the experts (`register`), or `attach` does
    (fp32 with ZeRO-0: our AdamW itself). Module docstring."""
    return (precision, zero_stage) != ("fp32", 0)


def expert_modules(module) -> list:
    """The sparse decoder layers this rank holds (DualPipeV's two stages included)."""
    layers = []
    for phase in module.phases():
        module.activate_phase(phase)
        layers += [m for m in module.forward_funcs if getattr(m, "sparse", False)]
    module.activate_phase(0)
    return layers


def expert_params(module) -> list[torch.nn.Parameter]:
    return [p for layer in expert_modules(module) for p in layer.moe_block().experts.parameters()]


def _gather(t: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """Every rank's `t` (its experts along dim 0), in EP rank order."""
    parts = [torch.empty_like(t) for _ in range(ep.size)]
    dist.all_gather(parts, t.contiguous(), group=ep.group)
    return torch.cat(parts)


def _slice(t: torch.Tensor, ep: ExpertParallel, local: int) -> torch.Tensor:
    """This rank's experts of a tensor that holds all of them along dim 0."""
    return t[ep.rank * local : (ep.rank + 1) * local].clone() if t.shape[0] != local else t


def keep_from_broadcast(module) -> None:
    """DeepSpeed's engine broadcasts every parameter from DP rank 0 at start-up, which would give every rank rank
    0's experts; it skips parameters marked `ds_optim_param` (DeepSpeed 0.19.8, `DeepSpeedEngine._broadcast_model`),
    so mark the experts. `attach` then broadcasts them within the ranks that hold the same experts."""
    for p in expert_params(module):
        p.ds_optim_param = True


def group_name(ep: ExpertParallel) -> str:
    """DeepSpeed's name for the groups of an expert-parallel degree (`deepspeed.moe.layer.MoE.expert_group_name`)."""
    return f"ep_size_{ep.size}"


def register(module, ep: ExpertParallel, tp: int) -> None:
    """Before `deepspeed.initialize`: our EP and expert-data groups in DeepSpeed's group registry under its name for
    them, and every expert parameter marked as DeepSpeed's MoE layers mark theirs (`allreduce=False`, `group_name`):
    `training.engine.param_groups` then gives them optimizer groups of their own. `tp`: the experts are split over
    the TP ranks too, so DeepSpeed sums their norm over the model-parallel group (`expert_tensor_parallel_world_size`).
    """
    from deepspeed.utils import groups

    name = group_name(ep)
    groups._EXPERT_PARALLEL_GROUP[name] = ep.group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep.group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = ep.data_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep.data_group)
    groups.expert_tensor_parallel_world_size = tp
    for p in expert_params(module):
        p.allreduce, p.group_name = False, name


class _ExpertsMarker(MoE):
    """What DeepSpeed's engine looks for to turn on its MoE bookkeeping: an instance of its own MoE layer
    (DeepSpeed 0.19.8, `DeepSpeedEngine._configure_distributed_model`). No parameters, never run; our groups are
    registered already (`register`), so it has nothing to set up."""

    def __init__(self, num_experts: int):
        torch.nn.Module.__init__(self)
        self.num_experts = num_experts

    def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
        pass

    def forward(self, *args, **kwargs):
        raise RuntimeError("a marker for DeepSpeed's engine, not a layer")


@contextlib.contextmanager
def deepspeed_sees_experts(module, num_experts: int):
    """Within (around `deepspeed.initialize`): the stage holds a marker DeepSpeed's engine takes for its MoE layer,
    when any expert trains (LoRA freezes them: no expert optimizer group to configure)."""
    if not any(p.requires_grad for p in expert_params(module)):
        yield
        return
    module.add_module("deepspeed_moe_marker", _ExpertsMarker(num_experts))
    try:
        yield
    finally:
        del module._modules["deepspeed_moe_marker"]


@contextlib.contextmanager
def checkpoint_files_as_ours(engine):
    """Within (around save_checkpoint and load_checkpoint): DeepSpeed writes and reads the pipeline's own layer files
    and ZeRO shards, not its MoE layout (one file per expert, which our gathered layer files replace)."""
    saved, engine.has_moe_layers = engine.has_moe_layers, False
    try:
        yield
    finally:
        engine.has_moe_layers = saved


def attach(engine, ep: ExpertParallel) -> None:
    """Reduce expert gradients over their own group and count them once in the global norm (module docstring)."""
    module, dp = engine.module, engine.dp_world_size
    first = dist.get_global_rank(ep.data_group, 0)
    for p in expert_params(module):  # the ranks holding the same experts start alike (as DeepSpeed makes DP replicas)
        dist.broadcast(p.data, first, group=ep.data_group)
    experts = [p for p in expert_params(module) if p.requires_grad]  # (LoRA freezes them: nothing to reduce)
    ids = {id(p) for p in experts}
    collect = engine._get_gradients_for_reduction

    def without_experts():
        grads, expert_grads = collect()
        keep = [g for g, p in zip(grads, _params_with_grads(module), strict=True) if id(p) not in ids]
        return keep, expert_grads

    reduce_all = engine.allreduce_gradients

    def allreduce_gradients(*args, **kwargs):
        reduce_all(*args, **kwargs)
        if engine.is_gradient_accumulation_boundary():
            for p in experts:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=ep.data_group)
                p.grad.div_(dp)

    engine._get_gradients_for_reduction = without_experts
    engine.allreduce_gradients = allreduce_gradients
    optimizer = engine.optimizer

    def clip_and_record():
        from deepspeed.runtime.utils import is_model_parallel_parameter

        mpu = engine.mpu
        shared, own = torch.zeros((), device=engine.device), torch.zeros((), device=engine.device)  # grads': a GPU
        for p in module.parameters():
            if p.grad is None:
                continue
            if id(p) in ids:  # this rank's experts: a TP shard on every TP rank, a whole tensor on TP rank 0
                if is_model_parallel_parameter(p):  # (gpt-oss's down biases; flagged by training.engine)
                    own += p.grad.detach().float().pow(2).sum()
            elif mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(p):
                shared += p.grad.detach().float().pow(2).sum()
        dist.all_reduce(own, group=ep.group)  # every expert of the stage once
        total = torch.stack([shared, own])
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
        norm = float(total.sum().sqrt())
        engine._global_grad_norm = norm
        optimizer.overflow = not math.isfinite(norm)
        coef = engine.gradient_clipping() / (norm + 1e-6)
        if coef < 1:
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)

    engine.clip_fp32_gradients = clip_and_record


def count_whole_experts_once(optimizer) -> None:
    """DeepSpeed's bf16 optimizer (`BF16_Optimizer.get_grads_for_norm`, deepspeed 0.19.8) counts every expert
    gradient on every TP rank, then sums over the model-parallel group: right for experts split over TP, but an
    expert tensor every TP rank holds whole (gpt-oss's down biases, `models.tp_rules.tp_split` REPLICA) would
    count once per TP rank. Leave those out of the norm where they are not flagged `model_parallel` (every TP
    rank but 0: training.engine flags them); they are still clipped."""
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.runtime.utils import is_model_parallel_parameter

    grads = getattr(optimizer, "fp32_groups_gradients", None)
    if grads is None:  # not the bf16 optimizer: DeepSpeed's ZeRO optimizer counts them by the flag already
        return
    whole = {
        id(grads[i][j])
        for i, group in enumerate(optimizer.bf16_groups)
        for j, lp in enumerate(group)
        if is_moe_param(lp) and not is_model_parallel_parameter(lp)
    }
    if not whole:
        return
    grads_for_norm = optimizer.get_grads_for_norm

    def without_whole_copies(for_clipping=False):
        if for_clipping:
            return grads_for_norm(for_clipping=True)
        dense, experts = grads_for_norm()
        return dense, {name: [g for g in gs if id(g) not in whole] for name, gs in experts.items()}

    optimizer.get_grads_for_norm = without_whole_copies


def _params_with_grads(module) -> list:
    """The parameters `DeepSpeedEngine._get_gradients_for_reduction` returns gradients of, in its order."""
    return [p for p in module.parameters() if p.requires_grad and p.numel() > 0]


@contextlib.contextmanager
def every_expert(engine, ep: ExpertParallel):
    """Within: the layer files DeepSpeed writes hold every expert, and our AdamW (fp32 ZeRO-0) every expert's Adam
    moments. DeepSpeed writes both from DP rank 0 only, so only the EP group holding DP rank 0 (DP ranks 0 .. E-1)
    gathers; all ranks enter. The moments are gathered up front (DeepSpeed saves the optimizer in one file); the
    experts one sparse layer at a time, as DeepSpeed writes that layer (`_gathered_while_saving`)."""
    if engine.grid.data_parallel_id >= ep.size:  # a group that writes nothing
        with checkpoint_files_as_ours(engine):
            yield
        return
    # Frozen experts (LoRA) are never saved: only adapters are.
    layers = [
        m for m in expert_modules(engine.module) if any(p.requires_grad for p in m.moe_block().experts.parameters())
    ]
    # Only our AdamW (fp32 ZeRO-0) holds the moments per parameter; DeepSpeed's optimizers save each rank's shard.
    state = engine.optimizer.state if steps_each_parameter(engine.optimizer) else {}
    kept = {}
    for layer in layers:
        for p in layer.moe_block().experts.parameters():
            if p in state:
                kept[p] = dict(state[p])
                state[p] = {k: _gather(v, ep) if torch.is_tensor(v) and v.dim() else v for k, v in state[p].items()}
    try:
        with checkpoint_files_as_ours(engine), _gathered_while_saving(engine.module, layers, ep):
            yield
    finally:
        for p, moments in kept.items():
            state[p] = moments


@contextlib.contextmanager
def _gathered_while_saving(module, layers: list, ep: ExpertParallel):
    """Within: `module.save_state_dict` (DeepSpeed's layer-file writer, which returns at once on every DP rank but 0)
    gathers each sparse layer's experts over the EP group right before DP rank 0 takes that layer's state dict,
    dropping the previous layer's: one layer's experts gathered at a time, not the stage's. DP rank 0 announces each
    layer it is about to save (its index in `layers`, then -1); the other EP ranks serve those gathers meanwhile."""
    if not layers:
        yield
        return
    device = next(layers[0].moe_block().experts.parameters()).device
    first = dist.get_global_rank(ep.group, 0)  # DP rank 0: the EP group holding it is DP ranks 0 .. E-1

    def announce(index: int | None) -> int:
        t = torch.tensor([-1 if index is None else index], device=device)
        dist.broadcast(t, first, group=ep.group)
        return int(t.item())

    def gather(layer) -> dict[str, torch.Tensor]:  # every parameter of the experts (gpt-oss's biases too)
        return {name: _gather(p.detach(), ep) for name, p in layer.moe_block().experts.named_parameters()}

    def before_state_dict(layer, *args):
        announce(layers.index(layer))
        for other in layers:
            other.gathered_experts = None
        layer.gathered_experts = gather(layer)

    write = module.save_state_dict

    def save_state_dict(*args, **kwargs):
        if ep.rank != 0:
            while (index := announce(None)) >= 0:
                gather(layers[index])
            return None
        hooks = [layer.register_state_dict_pre_hook(before_state_dict) for layer in layers]
        try:
            return write(*args, **kwargs)
        finally:
            for hook in hooks:
                hook.remove()
            for layer in layers:
                layer.gathered_experts = None
            announce(-1)

    module.save_state_dict = save_state_dict
    try:
        yield
    finally:
        del module.save_state_dict  # the class's method again


def keep_own_experts(engine, ep: ExpertParallel) -> None:
    """After a resume: the optimizer's Adam moments of each expert parameter hold every expert (saved gathered);
    keep this rank's (fp32 ZeRO-0; DeepSpeed's optimizers load each rank's own shard)."""
    if not steps_each_parameter(engine.optimizer):
        return
    state = engine.optimizer.state
    for p in expert_params(engine.module):
        if p in state:
            state[p] = {
                k: _slice(v, ep, p.shape[0]) if torch.is_tensor(v) and v.dim() else v for k, v in state[p].items()
            }


@contextlib.contextmanager
def universal_load_by_name(engine):
    """A universal resume of a model with experts under DeepSpeed's optimizers (the experts' state assembled by
    checkpoint/expert_universal.py). DeepSpeed's loader (`load_hp_checkpoint_state_from_checkpoint_dir`, deepspeed
    0.19.8 runtime/base_optimizer.py) pairs this run's optimizer groups with the saved ones by position, reads only as
    many as were saved and copies the saved groups' settings onto them; the LR scheduler's state has one entry per
    group too. Experts have groups of their own at E > 1 and none at E = 1 (training.engine.param_groups), so another
    E shifts the groups; under Muon (`optim.name=muon`) a stage of decoder blocks alone has no AdamW group of
    matrices where the saving stage with the embedding had one. Here every group of this run reads its parameters'
    state by name as DeepSpeed reads it (each rank's experts, TP shard and DP fragment), keeps its own settings, and
    the scheduler's per-group lists are fitted to this run's groups (one schedule drives them all)."""
    from deepspeed.runtime.base_optimizer import _get_universal_checkpoint_ep_info
    from deepspeed.runtime.utils import bwc_tensor_model_parallel_rank
    from deepspeed.utils.tensor_fragment import map_to_flat_opt_states

    from checkpoint.safe_load import deepspeed_data_classes

    optimizer, scheduler = engine.optimizer, engine.lr_scheduler

    def load(lp_groups_name: str, checkpoint_dir: str) -> None:
        folder = os.path.join(checkpoint_dir, "zero")
        with torch.serialization.safe_globals(deepspeed_data_classes()):
            optimizer._load_global_state(torch.load(os.path.join(folder, "optimizer_state.pt"), weights_only=True))
        tp_rank = bwc_tensor_model_parallel_rank(mpu=optimizer.mpu)
        tp_size = optimizer.mpu.get_slice_parallel_world_size()
        ep_rank, ep_size = _get_universal_checkpoint_ep_info()  # our EP group, registered as DeepSpeed's (`register`)
        lp_groups = getattr(optimizer, lp_groups_name)
        for i, group in enumerate(optimizer.optimizer.param_groups):
            keys, steps = set(), []
            for lp in lp_groups[i]:
                if lp._hp_mapping is not None:
                    path = os.path.join(folder, optimizer.param_names[lp])
                    steps.append(lp.load_hp_checkpoint_state(path, tp_rank, tp_size, ep_rank=ep_rank, ep_size=ep_size))
                    keys.update(lp._hp_mapping.get_optim_state_keys())
            hp = group["params"][0]
            if steps and steps[0] is not None:
                optimizer.optimizer.state[hp]["step"] = steps[0]
            map_to_flat_opt_states(hp, lp_groups[i], optimizer.optimizer.state, keys)

    def load_schedule(state: dict) -> None:
        groups = len(scheduler.optimizer.param_groups)
        state = dict(state)
        for key in ("base_lrs", "_last_lr", "lr_lambdas"):
            if isinstance(state.get(key), list) and state[key]:
                state[key] = [state[key][0]] * groups
        return load_scheduler_state(state)

    load_scheduler_state = scheduler.load_state_dict
    # NOTE: instance attributes for the load only, then deleted: LambdaLR.state_dict() saves its instance __dict__
    optimizer.load_hp_checkpoint_state_from_checkpoint_dir, scheduler.load_state_dict = load, load_schedule
    try:
        yield
    finally:
        del optimizer.load_hp_checkpoint_state_from_checkpoint_dir, scheduler.load_state_dict
