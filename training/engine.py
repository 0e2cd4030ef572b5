"""Distributed start-up and the DeepSpeed pipeline engine: topology, precision, optimizer, schedule."""

from __future__ import annotations

import contextlib
import glob
import math
import os
import socket
from datetime import timedelta

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from deepspeed.runtime.utils import clip_grad_norm_

from checkpoint.layer_files import find_layer_file, load_layer_state
from models.layers import init_weights
from models.layout import layer_file_name
from models.pipeline import build_pipeline_module
from training.config import TrainConfig


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_minutes: float = 30.0) -> tuple[int, int]:
    """Join the process group started by `deepspeed`/`torchrun`, or make a one-rank group for `python`.

    Returns:
        (global rank, world size).
    """
    if "RANK" not in os.environ:  # plain `python trainer.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it
    timeout = timedelta(minutes=timeout_minutes)
    # NOTE: `new_group()` without a timeout takes torch's module default (30 min), not the one given to
    # init_process_group, and DeepSpeed builds its pipeline/data groups that way: set the default too,
    # so a collective stuck on a dead or hung rank errors out after `dist_timeout_minutes` everywhere.
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=timeout, verbose=False)
        release_shm_buffers()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def release_shm_buffers() -> None:
    """Unlink this rank's DeepSpeed CPU all-reduce buffer from /dev/shm once every rank has mapped it.

    NOTE: DeepSpeed's CPU `deepspeed_shm_comm` op creates a 66 MB /dev/shm segment per rank
    (`deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`) and never unlinks it, so every run
    leaves world_size x 66 MB of RAM behind (22 GB after one afternoon of test runs). The mappings
    stay valid after unlinking and the memory is freed when the processes exit.
    """
    dist.barrier()  # every rank has opened every other rank's segment inside init_distributed
    port, rank = os.environ.get("MASTER_PORT", ""), dist.get_rank()
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        with contextlib.suppress(OSError):
            os.unlink(path)


def resolve_precision(precision: str) -> str:
    if precision != "auto":
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def resolve_zero_stage(zero_stage: int | None) -> int:
    return zero_stage if zero_stage is not None else (1 if torch.cuda.is_available() else 0)


def deepspeed_config(cfg: TrainConfig, dp_size: int, load_universal: bool = False) -> dict:
    """The engine config. Batch sizes and clipping come from the top-level run config.

    Args:
        cfg: run config.
        dp_size: data-parallel ranks.
        load_universal: the checkpoint to resume is a DeepSpeed universal checkpoint (layout change).
    """
    ds = cfg.deepspeed
    precision = resolve_precision(ds.precision)
    zero_stage = resolve_zero_stage(ds.zero_stage)
    if ds.offload_optimizer and precision == "bf16":
        raise ValueError(
            "deepspeed.offload_optimizer=true with bf16 is not supported by DeepSpeed's pipeline engine "
            "(DeepSpeed issue 3866); use deepspeed=fp16_offload"
        )
    if ds.offload_optimizer and zero_stage < 1:
        raise ValueError("deepspeed.offload_optimizer=true needs deepspeed.zero_stage=1")
    conf = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "train_batch_size": cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp_size,
        # NOTE: clipping always on (inf = compute the norm, never clip) so grad_norm is always reported.
        "gradient_clipping": cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf"),
        "steps_per_print": ds.steps_per_print,
        "wall_clock_breakdown": ds.wall_clock_breakdown,
        "pipeline": {"use_reentrant": False},  # non-reentrant activation checkpointing
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,
    }
    if precision == "bf16":
        conf["bf16"] = {"enabled": True}
        conf["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype or "fp32"}
    elif precision == "fp16":
        conf["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": ds.initial_scale_power}
    elif ds.grad_accum_dtype:
        conf["data_types"] = {"grad_accum_dtype": ds.grad_accum_dtype}
    if load_universal:
        conf["checkpoint"] = {"load_universal": True}
    if ds.offload_optimizer:
        conf["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    return conf


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """Decay matrices; never norms or biases (ndim < 2). Name-free, so HF references group alike."""
    params = [p for _, p in named_params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
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


def make_optimizer(cfg: TrainConfig, named_params, total_steps: int):
    """AdamW and its LR schedule; the single-process reference in the tests uses these too."""
    o = cfg.optim
    kwargs = {"lr": cfg.learning_rate, "betas": (o.beta1, o.beta2), "eps": o.eps}
    if torch.cuda.is_available():
        kwargs["fused"] = True
    optimizer = torch.optim.AdamW(param_groups(named_params, o.weight_decay), **kwargs)
    warmup = o.warmup_steps or int(o.warmup_ratio * total_steps)
    schedule = WarmupDecay(total_steps, warmup, o.lr_scheduler, o.min_lr_ratio)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def build_module(cfg: TrainConfig, llama_config, loss_fn, skip_init: bool = True):
    """Build this rank's pipeline stage (and nothing else).

    Args:
        cfg: run config.
        llama_config: `LlamaConfig` of the model, attention implementation set.
        loss_fn: `CausalLMLoss`.
        skip_init: leave weights uninitialised because a checkpoint will overwrite them.
    """
    dp = dist.get_world_size() // cfg.num_stages
    topology = PipeModelDataParallelTopology(num_pp=cfg.num_stages, num_mp=1, num_dp=dp)
    module = build_pipeline_module(
        llama_config,
        topology,
        partition=cfg.model.partition,
        activation_checkpointing=cfg.model.activation_checkpointing,
        loss_fn=loss_fn,
        skip_init=skip_init,
    )
    if not skip_init:
        init_weights(module, llama_config.initializer_range)
        module._synchronize_tied_weights()
    return module


def load_layer_files(module, step_dir: str, trainable_only: bool = False) -> list[str]:
    """Load this stage's layer files from `step_dir`. Returns the files read.

    Every parameter must be in the files, or with `trainable_only` (a LoRA checkpoint, which holds
    the adapter only) every trainable one; a key the model lacks is an error either way.

    Only this rank's own layers are opened, each once (memory-mapped); tied weights are then
    broadcast from the first stage that holds them. NOTE: DeepSpeed's `load_state_dir` reads every
    layer file twice (once to check its metadata), which doubles start-up I/O on large models.
    """
    files = []
    for i, layer in enumerate(module.forward_funcs):
        if not hasattr(layer, "load_state_dict"):  # the tied LM head: a function of layer 0's module
            continue
        index = module._local_start + i
        path = find_layer_file(step_dir, index)
        if path is None:
            raise FileNotFoundError(f"{os.path.join(step_dir, layer_file_name(index))}: layer file missing")
        state = load_layer_state(path, mmap=True)
        try:
            missing, unexpected = layer.load_state_dict(state, strict=not trainable_only)
        except RuntimeError as e:
            first = str(e).strip().splitlines()
            raise FileNotFoundError(f"{path}: does not fit this model ({' '.join(first[:2])[:300]})") from None
        trainable = {n for n, p in layer.named_parameters() if p.requires_grad}
        if unexpected or trainable & set(missing):
            bad = f"unexpected {unexpected[0]}" if unexpected else f"missing {sorted(trainable & set(missing))[0]}"
            raise FileNotFoundError(f"{path}: does not fit this model ({bad})")
        files.append(path)
    module._synchronize_tied_weights()
    return files


def initialize_engine(cfg: TrainConfig, module, total_steps: int, load_universal: bool = False):
    """Wrap a built stage in DeepSpeed's PipelineEngine with AdamW and the LR schedule."""
    dp = dist.get_world_size() // cfg.num_stages
    # NOTE: DeepSpeed's fp32 gradient clipping sums norms over the model-parallel group, which in a
    # pipeline is every stage, but only counts parameters flagged `model_parallel` on ranks other than
    # its rank 0: without the flag, stages > 0 drop out of the norm. Tied copies stay unflagged
    # (`ds_pipe_replicated`) so they count once. The bf16/ZeRO paths key on the tensor-parallel rank.
    # Flagged here, after any LoRA injection, so adapter parameters count too.
    for p in module.parameters():
        p.model_parallel = not getattr(p, "ds_pipe_replicated", False)
    optimizer, scheduler = make_optimizer(cfg, module.named_parameters(), total_steps)
    config = deepspeed_config(cfg, dp, load_universal)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=config)

    # NOTE: DeepSpeed's fp32 path clips but does not record the norm; keep it for the metrics. It would
    # also apply an update from NaN/inf gradients, where its bf16/fp16 optimizers skip the step: mark such
    # a step as an overflow so the fp32 path skips it the same way (weights, Adam moments and the LR
    # schedule unchanged; DeepSpeed counts it in `skipped_steps`).
    optimizer = engine.optimizer
    if type(optimizer) is torch.optim.AdamW:  # fp32 without ZeRO: our AdamW itself, not a DeepSpeed wrapper
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
    return engine
