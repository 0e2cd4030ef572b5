"""Expert parallelism in the DeepSpeed engine: the expert gradients' own reduction, the global norm counting every
expert once, and checkpoints that hold every expert whatever the EP degree (models/expert_parallel.py splits the
experts; this module does what the engine must do about it).

- Gradients. An expert's gradient already sums the tokens its EP group routed to it (the all-to-all's backward);
  the DP / E ranks holding the same experts add theirs (`ep.data_group`) and divide by the DP size, as DeepSpeed
  averages everything else over DP. DeepSpeed's own reduction skips the expert parameters (it would add different
  experts that share a slot on different ranks).
- Clipping. The global norm adds the non-expert gradients once (DeepSpeed's model-parallel rule) and the experts
  of every rank of the EP group once.
- Checkpoints. Layer files hold every expert (gathered over the EP group before DeepSpeed writes them) and so does
  the optimizer state DeepSpeed's DP rank 0 saves (each expert parameter's Adam moments gathered likewise); at load
  each rank keeps its experts' slices, so a run resumes with any EP degree.

fp32 with ZeRO-0 (DeepSpeed's basic optimizer: our AdamW itself); training/validate.py refuses the others.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from models.expert_parallel import ExpertParallel


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
        shared, own = torch.zeros(()), torch.zeros(())
        for p in module.parameters():
            if p.grad is None:
                continue
            if id(p) in ids:  # this rank's experts (split over TP too: every TP rank counts its shard)
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


def _params_with_grads(module) -> list:
    """The parameters `DeepSpeedEngine._get_gradients_for_reduction` returns gradients of, in its order."""
    return [p for p in module.parameters() if p.requires_grad and p.numel() > 0]


@contextlib.contextmanager
def every_expert(engine, ep: ExpertParallel):
    """Within: sparse layers save every expert (`gathered_experts`, read by models/moe.py's key hooks) and the
    optimizer holds every expert's Adam moments. DeepSpeed writes layer files and the ZeRO-0 optimizer state from
    DP rank 0 only, so only the EP group holding DP rank 0 (DP ranks 0 .. E-1) gathers; all ranks enter."""
    if engine.grid.data_parallel_id >= ep.size:  # a group that writes nothing
        yield
        return
    # Frozen experts (LoRA) are never saved: only adapters are.
    layers = [m for m in expert_modules(engine.module) if m.moe_block().experts.gate_up_proj.requires_grad]
    state = engine.optimizer.state
    kept = {}
    for layer in layers:
        experts = layer.moe_block().experts
        layer.gathered_experts = (_gather(experts.gate_up_proj.detach(), ep), _gather(experts.down_proj.detach(), ep))
        for p in experts.parameters():
            if p in state:
                kept[p] = dict(state[p])
                state[p] = {k: _gather(v, ep) if torch.is_tensor(v) and v.dim() else v for k, v in state[p].items()}
    try:
        yield
    finally:
        for layer in layers:
            layer.gathered_experts = None
        for p, moments in kept.items():
            state[p] = moments


def keep_own_experts(engine, ep: ExpertParallel) -> None:
    """After a resume: the optimizer's Adam moments of each expert parameter hold every expert (saved gathered);
    keep this rank's."""
    state = engine.optimizer.state
    for p in expert_params(engine.module):
        if p in state:
            state[p] = {
                k: _slice(v, ep, p.shape[0]) if torch.is_tensor(v) and v.dim() else v for k, v in state[p].items()
            }
