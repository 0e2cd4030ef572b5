"""The DeepSpeed pipeline engine: precision, engine config, optimizer, LR schedule, the built stage."""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager, nullcontext

import deepspeed
import torch
from deepspeed.moe.utils import is_moe_param
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.utils import clip_grad_norm_

from checkpoint.universal import universal_info
from models.carry import floating_slots
from models.context_parallel import ContextParallel
from models.expert_parallel import ExpertParallel
from models.initialization import init_weights
from models.layers import DecoderOptions, DecoderPipe, block_index
from models.moe import num_experts
from models.pipeline import build_pipeline_module
from models.sharding import REPLICA
from models.tensor_parallel import TensorParallel
from models.tp_rules import param_tp_split
from schema.model import checkpoint_every
from schema.train import TrainConfig, sequence_parallel
from training.backward_prologue import prologue_on_the_loss
from training.deepspeed_patches import CHECKED_AGAINST
from training.expert_parallel import (
    attach,
    count_whole_experts_once,
    deepspeed_owns_experts,
    deepspeed_sees_experts,
    keep_from_broadcast,
    register,
)
from training.muon import MuonAdamW, muon_plan, steps_each_parameter
from training.precision import is_resolved
from training.topology import Coords


def describe_auto_precision(precision: str) -> str:
    """The log line for `deepspeed.precision=auto`: what it chose and why."""
    why = {
        "bf16": "bf16 with fp32 master weights (this GPU supports bf16)",
        "fp16": "fp16 with dynamic loss scaling (this GPU has no bf16)",
        "fp32": "fp32 (no GPU)",
    }
    return f"deepspeed.precision=auto: {why[precision]}"


def deepspeed_config(cfg: TrainConfig, coords: Coords, load_universal: bool = False, experts: bool = False) -> dict:
    """The engine config. Batch sizes and clipping come from the top-level run config.

    Args:
        cfg: run config.
        coords: where this rank sits (the DP size).
        load_universal: the checkpoint to resume is a DeepSpeed universal checkpoint (layout change).
        experts: the stages send floating tensors besides the hidden states that take a gradient (a model's
            router statistics, carried K/V or per-layer inputs: `models.carry.floating_slots`).
    """
    ds = cfg.deepspeed
    if not is_resolved(ds):
        raise ValueError("deepspeed_config builds from the resolved config (training.precision.resolve)")
    precision, zero_stage = str(ds.precision), ds.zero_stage
    conf = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        # DeepSpeed's data-parallel ranks: the CP ranks of a replica count as ranks of it (training/topology.py)
        "train_batch_size": coords.global_batch(cfg.micro_batch_size, cfg.gradient_accumulation_steps) * coords.cp,
        # NOTE: clipping always on (inf = compute the norm, never clip) so grad_norm is always reported.
        "gradient_clipping": cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf"),
        "steps_per_print": ds.steps_per_print,
        "wall_clock_breakdown": ds.wall_clock_breakdown,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        conf["bf16"] = {"enabled": True}
        conf["data_types"] = {"grad_accum_dtype": str(ds.grad_accum_dtype or "fp32")}
    elif precision == "fp16":
        conf["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": ds.initial_scale_power}
    elif ds.grad_accum_dtype:
        conf["data_types"] = {"grad_accum_dtype": str(ds.grad_accum_dtype)}
    if load_universal:
        conf["checkpoint"] = {"load_universal": True}
    if cfg.pipeline_schedule == "dualpipev" or sequence_parallel(cfg) or (experts and coords.tp > 1):
        # NOTE: under sequence parallelism each TP rank's stage output is its own S/T positions: it sends them as
        # they are (DeepSpeed's partitioning would cut a tensor that differs between ranks). Without it,
        # DeepSpeed's DualPipeV engine cannot split stage-to-stage tensors across the TP group, and its 1F1B
        # engine splits only stage outputs whose tensors after the first take no gradient (a model with experts
        # sends its router statistics, Gemma 4 its per-layer inputs and shared K/V, each TP rank's own heads):
        # each TP rank sends the whole activation (T times the per-rank traffic).
        conf["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if ds.offload_optimizer:
        conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        # Our AdamW steps the CPU partitions: DeepSpeed otherwise insists on its own CPU Adam, refusing the run.
        conf["zero_force_ds_cpu_optimizer"] = False
    return conf


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms or biases (ndim < 2). Name-free, so HF references group alike. Experts that
    DeepSpeed's optimizers reduce over a group of their own (marked by `training.expert_parallel.register`) get
    optimizer groups of their own, marked as DeepSpeed's MoE groups are (`moe`, the group's `name`)."""
    params = [p for _, p in named_params if p.requires_grad]
    groups = []
    for decay, matrices in ((weight_decay, True), (0.0, False)):
        chosen = [p for p in params if (p.ndim >= 2) == matrices]
        groups.append({"params": [p for p in chosen if not is_moe_param(p)], "weight_decay": decay})
        for name in sorted({p.group_name for p in chosen if is_moe_param(p)}):
            experts = [p for p in chosen if is_moe_param(p) and p.group_name == name]
            groups.append({"params": experts, "weight_decay": decay, "moe": True, "name": name})
    # NOTE: DeepSpeed drops empty groups (LoRA has no 1-D trainables); the LR scheduler must see the same list.
    return [g for g in groups if g["params"]]


class WarmupDecay:
    """LR multiplier: linear warmup, then cosine/linear decay to `min_ratio`, or constant.

    A class (not a closure) so `LambdaLR.state_dict()` records it and resumes restore it.
    """

    def __init__(self, total_steps: int, warmup_steps: int, kind: str, min_ratio: float):
        self.total_steps, self.warmup_steps, self.kind, self.min_ratio = total_steps, warmup_steps, kind, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * decay


def lr_schedule(cfg: TrainConfig, total_steps: int) -> WarmupDecay:
    """The LR multiplier of `cfg` over `total_steps` optimizer steps."""
    o = cfg.optim
    warmup = o.warmup_steps or int(o.warmup_ratio * total_steps)
    return WarmupDecay(total_steps, warmup, str(o.lr_scheduler), o.min_lr_ratio)


def follow_new_schedule(scheduler, cfg: TrainConfig, total_steps: int) -> list[str]:
    """After a resume: the restored LR schedule (the checkpoint's settings) replaced by this run's, from the
    restored step on, as an uninterrupted run with these settings would have it. Returns what changed
    ("max_steps/num_train_epochs: 3 -> 5 steps", ...), empty when nothing did.

    NOTE: `LambdaLR.load_state_dict` restores the schedule object's fields and the base learning rates, so
    without this a run resumed with max_steps=5 kept decaying toward the old max_steps=3 floor."""
    new, base = lr_schedule(cfg, total_steps), cfg.learning_rate
    changes = []
    for old in scheduler.lr_lambdas:
        for field, what in (
            ("total_steps", "max_steps/num_train_epochs (total steps)"),
            ("warmup_steps", "warmup steps"),
            ("kind", "optim.lr_scheduler"),
            ("min_ratio", "optim.min_lr_ratio"),
        ):
            before, after = getattr(old, field, None), getattr(new, field)
            if before != after:
                changes.append(f"{what}: {before} -> {after}")
        old.__dict__.update(new.__dict__)
    if any(b != base for b in scheduler.base_lrs):
        changes.append(f"learning_rate: {scheduler.base_lrs[0]:g} -> {base:g}")
    scheduler.base_lrs = [base] * len(scheduler.base_lrs)
    step = scheduler.last_epoch  # optimizer steps done: the next one uses base * multiplier(step)
    lrs = [base * fn(step) for fn in scheduler.lr_lambdas]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs
    return sorted(set(changes))


def make_optimizer(cfg: TrainConfig, named_params, total_steps: int, muon_plan=None, tp=None):
    """The optimizer of `optim.name` and its LR schedule; the single-process reference in the tests uses AdamW's too.

    Args:
        muon_plan: (name, parameter) -> how Muon updates it, or None for AdamW's (`training.muon.muon_plan`); needed
            for `optim.name=muon`.
        tp: this rank's tensor-parallel place (Muon gathers each split matrix over its group).
    """
    o = cfg.optim
    kwargs = {"lr": cfg.learning_rate, "betas": (o.beta1, o.beta2), "eps": o.eps}
    if torch.cuda.is_available() and not cfg.deepspeed.offload_optimizer:  # offloaded: the step runs on CPU tensors
        kwargs["fused"] = True
    if str(o.name) == "adamw":
        optimizer = torch.optim.AdamW(param_groups(named_params, o.weight_decay), **kwargs)
    else:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        plans = {id(p): plan for n, p in named if (plan := muon_plan(n, p)) is not None}
        matrices = param_groups([(n, p) for n, p in named if id(p) in plans], o.weight_decay)
        rest = param_groups([(n, p) for n, p in named if id(p) not in plans], o.weight_decay)
        groups = [{**g, "muon": True} for g in matrices] + [{**g, "muon": False} for g in rest]
        muon = {"momentum": o.muon_momentum, "nesterov": o.muon_nesterov, "ns_steps": o.muon_ns_steps}
        muon["ns_dtype"] = str(o.muon_ns_dtype)
        muon |= {"adjust_lr": str(o.muon_adjust_lr), "plan_of": lambda p: plans[id(p)], "tp": tp, "adamw": kwargs}
        optimizer = MuonAdamW(groups, lr=cfg.learning_rate, **muon)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg, total_steps))


def build_module(
    cfg: TrainConfig,
    coords: Coords,
    model_config,
    loss_fn,
    tp: TensorParallel,
    bounds: list[int],
    skip_init: bool = True,
):
    """Build this rank's pipeline stage (and nothing else; with tensor parallelism, its shard of it).

    Args:
        cfg: run config.
        coords: where this rank sits.
        model_config: transformers config of the model, attention implementation set.
        loss_fn: `CausalLMLoss`, or a pair loss (`models.preference`), which gets the stage's context-parallel place.
        tp: this rank's tensor-parallel place; its group is set while the stage is built.
        bounds: the stage bounds (`models.partition.stage_bounds`, computed once per run).
        skip_init: leave weights uninitialised because a checkpoint will overwrite them.
    """
    topology = PipeModelDataParallelTopology(num_pp=cfg.num_stages, num_mp=coords.tp, num_dp=coords.data_ranks)
    context = ContextParallel(coords.cp, coords.cp_rank)  # its group is set while the stage is built
    if hasattr(loss_fn, "context"):  # a pair loss sums each sequence's log-probs over the CP group
        loss_fn.context = context
    module = build_pipeline_module(
        model_config,
        topology,
        tp,
        bounds,
        options=DecoderOptions(
            packed=cfg.data.documents_share_rows,
            checkpoint_every=checkpoint_every(cfg.model),
            routed_experts=cfg.moe.routed_experts,
            context=context,
            mlp_tiles=cfg.model.mlp_tiles,
        ),
        loss_fn=loss_fn,
        skip_init=skip_init,
        dual=cfg.pipeline_schedule == "dualpipev",
        ep=ExpertParallel(cfg.expert_parallel_size),
    )
    if cfg.data.documents_share_rows and coords.rank == 0:
        log_masked_layers(module, cfg.seq_length)
    # Saved with the engine state (ZeRO-1 moves); a fused q/k/v projection's widths depend on the TP degree.
    module.universal_checkpoint_info = universal_info(model_config, cfg.tensor_parallel_size)
    if not skip_init:
        init_weights(module, model_config.initializer_range)
        module._synchronize_tied_weights()
    return module


def log_masked_layers(module, seq: int) -> None:
    """Name the decoder blocks of this stage that build a dense [S, S] mask on packed rows, and why (the others
    attend each document alone, or by flash-attn's variable-length path)."""
    masked = {}
    for layer in module.modules():
        if isinstance(layer, DecoderPipe) and (reason := layer.packed_mask_reason(seq)):
            masked.setdefault(reason, []).append(block_index(layer))
    for reason, blocks in masked.items():
        logging.getLogger(__name__).info("packed rows: decoder blocks %s take a dense [S, S] mask (%s)", blocks, reason)


def keep_buffer_dtypes(engine) -> None:
    """DeepSpeed's pipeline engine keeps one list of receive buffers for activations and gradients alike, by position
    in the stage's tuple, and reuses one whenever it is large enough, whatever its dtype. A model with experts sends
    (hidden, position_ids, lengths, stats): a middle stage then received the statistics' fp32 gradient (position 1
    of the float tensors) into position 1's int64 activation buffer, and its bytes read as integers reached every
    router (a gradient norm of inf). Reallocate a buffer whose dtype differs (DeepSpeed 0.19.8,
    `PipelineEngine._allocate_or_extend_buffers`)."""
    from functools import reduce
    from operator import mul

    allocate = engine._allocate_or_extend_buffers

    def same_dtype(idx, shape, dtype):
        numel = reduce(mul, shape) if len(shape) > 0 else 1
        buffers = engine._grad_layer_buf  # NOTE: reset_activation_shape() replaces the list
        if len(buffers) > idx and buffers[idx].dtype != dtype and buffers[idx].numel() >= numel:
            buffers[idx] = engine._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
        return allocate(idx, shape, dtype)

    engine._allocate_or_extend_buffers = same_dtype


@contextmanager
def frozen_weights_kept_fp32(module, precision: str):
    """DeepSpeed casts every parameter to the training dtype, frozen ones too. transformers keeps some in fp32 in
    that dtype (`Family.keeps_fp32`: DeepSeek-V3.2's frozen `indexer.weights_proj` under fp16): the frozen ones go
    back to their fp32 values after it (no optimizer holds them). Trained ones are refused (training/validate.py)."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(precision))
    layers = [m for m in module.modules() if hasattr(m, "keeps_fp32")]  # each by its own names (models/layers.py)
    named = [(layer.keeps_fp32, n, p) for layer in layers for n, p in layer.named_parameters()]
    kept = [(p, p.data.float()) for keep, n, p in named if dtype and not p.requires_grad and keep(n, dtype)]
    yield
    for param, data in kept:
        param.data = data.to(param.device)


def initialize_forward_engine(cfg: TrainConfig, coords: Coords, module):
    """DeepSpeed's pipeline engine for forward passes only (`eval_batch`): no optimizer, no optimizer state; the
    stage cast to the run's precision. The reference pass of `objective=dpo` runs it, then drops it."""
    config = deepspeed_config(cfg, coords, experts=floating_slots(module.model_config) > 0)
    config["zero_optimization"] = {"stage": 0}  # nothing to partition without an optimizer
    module.requires_grad_(False)  # nothing trains: what transformers keeps fp32 stays so (`frozen_weights_kept_fp32`)
    if module._ep.size > 1:  # each rank's own experts (as initialize_engine)
        keep_from_broadcast(module)
    with frozen_weights_kept_fp32(module, cfg.deepspeed.precision):
        engine, _, _, _ = deepspeed.initialize(model=module, config=config)
    keep_buffer_dtypes(engine)
    return engine


def initialize_engine(cfg: TrainConfig, coords: Coords, module, total_steps: int, load_universal: bool = False):
    """Wrap a built stage in DeepSpeed's PipelineEngine with AdamW and the LR schedule."""
    if deepspeed.__version__ != CHECKED_AGAINST and coords.rank == 0:  # (requirements.txt pins it)
        logging.getLogger(__name__).warning(
            "DeepSpeed %s is installed; this project's patches of it (training/deepspeed_patches.py) were checked "
            "against %s",
            deepspeed.__version__,
            CHECKED_AGAINST,
        )
    # NOTE: DeepSpeed sums gradient norms over its "model-parallel" group, which in a pipeline grid is every
    # stage and TP rank, and counts a parameter there only if it is flagged `model_parallel` (fp32 path: except
    # on that group's rank 0, which counts everything; bf16/ZeRO: except on TP rank 0). Flag every parameter
    # split across TP ranks, and replicated ones on TP rank 0 only, so each counts exactly once; tied copies
    # (`ds_pipe_replicated`) stay unflagged so they count once too. Flagged after any LoRA injection, so
    # adapter parameters count as well.
    config = module.model_config
    for name, p in module.named_parameters():
        split = param_tp_split(name, config.num_hidden_layers, config.tie_word_embeddings, config) != REPLICA
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False) and (coords.tp_rank == 0 or split)
    ep = module._ep
    deepspeed_experts = ep.size > 1 and deepspeed_owns_experts(cfg.deepspeed.precision, cfg.deepspeed.zero_stage)
    if deepspeed_experts:  # DeepSpeed's MoE bookkeeping reduces, shards and broadcasts them (expert-data group)
        register(module, ep, coords.tp)
    elif ep.size > 1:  # each rank's own experts: DeepSpeed must not broadcast DP rank 0's over them
        keep_from_broadcast(module)
    plan = lambda name, p, model_config=module.model_config: muon_plan(name, p, model_config)  # noqa: E731
    optimizer, scheduler = make_optimizer(cfg, module.named_parameters(), total_steps, plan, module._tp)
    config = deepspeed_config(cfg, coords, load_universal, experts=floating_slots(module.model_config) > 0)
    experts = deepspeed_sees_experts(module, num_experts(module.model_config)) if deepspeed_experts else nullcontext()
    with experts, frozen_weights_kept_fp32(module, cfg.deepspeed.precision):
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    if isinstance(optimizer, MuonAdamW) and isinstance(engine.optimizer, BF16_Optimizer):
        optimizer.step_partitions_of(engine.optimizer)  # it steps flat DP partitions of the master weights
    # NOTE: DeepSpeed copies its zero_to_fp32.py and zero_to_torch.py into every ZeRO checkpoint. They cannot read
    # pipeline checkpoints (the layer files carry no parameter shapes for them: "'NoneType' object has no attribute
    # 'items'"), so none is left for a user to run; `convert2ckpt.py --to-hf --dtype fp32` gets the weights out.
    engine._copy_recovery_script = lambda save_path: None
    keep_buffer_dtypes(engine)
    prologue_on_the_loss(engine)
    if deepspeed_experts and coords.tp > 1:
        count_whole_experts_once(engine.optimizer)
    if cfg.pipeline_schedule == "zero_bubble":
        from training.zero_bubble_engine import make_zero_bubble

        make_zero_bubble(engine)

    # NOTE: DeepSpeed's fp32 path clips but does not record the norm; keep it for the metrics. It would
    # also apply an update from NaN/inf gradients, where its bf16/fp16 optimizers skip the step: mark such
    # a step as an overflow so the fp32 path skips it the same way (weights, Adam moments and the LR
    # schedule unchanged; DeepSpeed counts it in `skipped_steps`).
    optimizer = engine.optimizer
    if steps_each_parameter(optimizer):  # fp32 without ZeRO: our optimizer itself, not a DeepSpeed wrapper
        optimizer.overflow = False
        apply_update = optimizer.step

        def guarded_step(*args, **kwargs):
            return None if optimizer.overflow else apply_update(*args, **kwargs)

        optimizer.step = guarded_step

    def clip_and_record():
        norm = clip_grad_norm_(engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu)
        engine._global_grad_norm = float(norm)
        optimizer.overflow = not math.isfinite(engine._global_grad_norm)

    engine.clip_fp32_gradients = clip_and_record
    if ep.size > 1 and not deepspeed_experts:  # expert gradients reduced over their own group, counted once
        attach(engine, ep)
    return engine
