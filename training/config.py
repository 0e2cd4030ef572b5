"""Typed run configuration, registered in hydra's ConfigStore so a misspelt key fails at start-up.

Each package owns its part (models.config: `model`, `lora`; data.config: `data`); this module composes
them with the training settings. Precedence: dataclass defaults < `conf/*.yaml` (groups model/, data/,
deepspeed/, experiment/) < command-line overrides. The config is passed explicitly; nothing reads a
global, and `validate` only reads it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

from data.config import DataConfig
from models.config import Choice, LoraSettings, ModelConfig, checkpoint_every
from models.sharding import tp_indivisible
from training.precision import resolve_precision, resolve_zero_stage

RESUME_MODES = ("true", "false", "auto")
OBJECTIVES = ("sft", "dpo")
SCHEDULES = ("1f1b", "zero_bubble", "dualpipev")


class Precision(Choice):
    auto = "auto"  # bf16 on a bf16-capable GPU, fp16 on other GPUs, fp32 on CPU
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Scheduler(Choice):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class NonFinite(Choice):
    stop = "stop"  # a NaN/inf loss ends the run without saving (last checkpoint kept)
    skip = "skip"  # skip that step's update and go on


@dataclass
class DeepSpeedConfig:
    """What goes into the DeepSpeed engine config (see `training.engine.deepspeed_config`)."""

    precision: Precision = Precision.auto
    zero_stage: int | None = None  # None: 1 on GPU, 0 on CPU; the pipeline engine allows <= 1
    offload_optimizer: bool = False  # CPU offload; DeepSpeed supports it under PP with fp16 only
    grad_accum_dtype: str | None = None  # None: fp32 when precision is bf16
    initial_scale_power: int = 16  # fp16 dynamic loss scale start, 2**N
    steps_per_print: int = 1_000_000  # DeepSpeed's own console line; we log every step ourselves
    wall_clock_breakdown: bool = False


@dataclass
class OptimConfig:
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    lr_scheduler: Scheduler = Scheduler.cosine
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1


@dataclass
class DpoConfig:
    """Preference tuning (`objective=dpo`): the loss on pairs and the reference whose log-probs it compares against."""

    beta: float = 0.1  # DPO's KL strength; IPO's tau; SimPO's reward scale
    loss_type: str = "sigmoid"  # sigmoid (DPO), ipo, simpo (reference-free, length-normalised)
    gamma: float = 0.5  # SimPO's target reward margin (TRL's simpo_gamma)
    sft_weight: float = 0.0  # adds the chosen completions' NLL with this weight (TRL's "sft" loss term, rpo_alpha)
    # An HF directory or a pipeline checkpoint; None: the starting weights (model_name_or_path; with LoRA, the base
    # without adapters). Its log-probs are computed once, before training, and cached beside the tokenized data.
    reference_model: str | None = None


@dataclass
class TrainConfig:
    model_name_or_path: str | None = None  # a converted pipeline checkpoint (convert2ckpt.py) or an HF directory
    tokenizer_name_or_path: str | None = None  # default: model_name_or_path
    output_dir: str = "outputs/run"
    num_stages: int = 1
    # 1f1b (DeepSpeed's), zero_bubble (weight gradients deferred into the bubble), dualpipev (two stages per rank
    # in a V, DeepSpeed's; needs gradient_accumulation_steps >= 2 x num_stages). NOTE: a string, not an Enum:
    # omegaconf matches Enum names, and "1f1b" is not one.
    pipeline_schedule: str = "1f1b"
    tensor_parallel_size: int = 1  # TP ranks per stage (adjacent ranks, one node): world = PP x TP x DP
    # With TP: each TP rank holds seq_length / TP positions between the split regions (norms, residual stream,
    # stage-to-stage tensors). None: on whenever tensor_parallel_size > 1; false: every rank holds them all.
    sequence_parallel: bool | None = None
    # NOTE: Any because omegaconf has no unions: a path (.jsonl, .json, .parquet, a datasets directory) or a list.
    train_file: Any = None
    eval_file: Any = None
    do_train: bool = True
    do_eval: bool | None = None  # None: evaluate when eval_file is given
    max_steps: int = -1  # > 0 overrides num_train_epochs
    num_train_epochs: int = 1
    seq_length: int = 512
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    eval_micro_batch_size: int | None = None  # default: micro_batch_size
    learning_rate: float = 2e-5
    seed: int = 42
    save_steps: int = 0  # 0: save only at the end
    save_manifest: bool = True  # sizes, sha256 and tensor shapes of every saved file (convert2ckpt.py --verify)
    eval_steps: int = 0  # 0: evaluate only at the end
    # NOTE: a string, not an Enum: omegaconf reads `resume=true` as a boolean before an Enum could see it.
    resume: str = "false"  # true: continue from the newest checkpoint in output_dir; auto: if there is one
    resume_from: str | None = None  # global_stepN: resume this (older) checkpoint on purpose; newer ones move aside
    overwrite_output_dir: bool = False  # a fresh run into an output_dir with checkpoints moves the earlier run aside
    nonfinite_loss: NonFinite = NonFinite.stop
    keep_last_n: int = 0  # keep only the newest N checkpoints (never the one `latest` names); 0: keep all
    logging_steps: int = 1
    log_all_ranks: bool = False  # INFO lines from every rank (default: rank 0 and the reporting rank)
    progress_bar: bool = True  # one tqdm bar on the reporting rank, when stderr is a terminal
    report_to: list[str] = field(default_factory=list)  # also send metrics to: tensorboard, wandb
    dist_timeout_minutes: float = 30.0  # a collective waiting this long for a failed/hung rank errors out
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    objective: str = "sft"  # sft: next-token loss on rows; dpo: preference pairs (the `dpo` settings)
    dpo: DpoConfig = field(default_factory=DpoConfig)


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="deepspeed", name="deepspeed_schema", node=DeepSpeedConfig)


def resume_mode(cfg: TrainConfig) -> str:
    """`resume` as one of RESUME_MODES ("True" from a YAML boolean reads as "true"); `resume_from` means true."""
    return "true" if cfg.resume_from else str(cfg.resume).lower()


def sequence_parallel(cfg: TrainConfig) -> bool:
    """Whether the run shards the sequence over its TP ranks (`sequence_parallel`; default: whenever TP > 1)."""
    return cfg.tensor_parallel_size > 1 and cfg.sequence_parallel is not False


def evaluating(cfg: TrainConfig) -> bool:
    """Whether the run evaluates: `do_eval` when set, else whenever an eval_file is given."""
    return cfg.do_eval if cfg.do_eval is not None else cfg.eval_file is not None


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _finite(value, key: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """`key`=`value` must be a finite number in the range; ValueError naming both otherwise."""
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    bounds = f"{lo}{low:g}, {'inf' if math.isinf(high) else f'{high:g}'}{hi}"
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    _need(ok, f"{key}={value} must be a finite number in {bounds}")


def validate_numbers(cfg: TrainConfig) -> None:
    """Every numeric setting finite and in range, so none trains into NaN weights or a wrong schedule."""
    o = cfg.optim
    _finite(cfg.learning_rate, "learning_rate", 0)
    _finite(o.weight_decay, "optim.weight_decay", 0)
    _finite(o.beta1, "optim.beta1", 0, 1, high_open=True)
    _finite(o.beta2, "optim.beta2", 0, 1, high_open=True)
    _finite(o.eps, "optim.eps", 0, low_open=True)
    _finite(o.max_grad_norm, "optim.max_grad_norm", 0)
    _finite(o.warmup_ratio, "optim.warmup_ratio", 0, 1)
    _finite(o.min_lr_ratio, "optim.min_lr_ratio", 0, 1)
    _need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _finite(cfg.dist_timeout_minutes, "dist_timeout_minutes", 0, low_open=True)
    _need(cfg.max_steps >= -1, f"max_steps={cfg.max_steps} must be -1 (use num_train_epochs) or a step count")
    _need(cfg.num_train_epochs >= 1 or cfg.max_steps > 0, f"num_train_epochs={cfg.num_train_epochs} must be >= 1")
    for key in ("save_steps", "eval_steps"):
        _need(getattr(cfg, key) >= 0, f"{key}={getattr(cfg, key)} must be >= 0")
    _need(cfg.logging_steps >= 1, f"logging_steps={cfg.logging_steps} must be >= 1")
    _need(cfg.eval_micro_batch_size is None or cfg.eval_micro_batch_size >= 1,
          f"eval_micro_batch_size={cfg.eval_micro_batch_size} must be >= 1")  # fmt: skip
    _need(cfg.deepspeed.steps_per_print >= 1, f"deepspeed.steps_per_print={cfg.deepspeed.steps_per_print} must be >= 1")
    _need(0 <= cfg.deepspeed.initial_scale_power <= 32,
          f"deepspeed.initial_scale_power={cfg.deepspeed.initial_scale_power} must be in [0, 32]")  # fmt: skip
    for key in ("tokenize_workers", "num_workers"):
        _need(getattr(cfg.data, key) >= 0, f"data.{key}={getattr(cfg.data, key)} must be >= 0")
    for i, w in enumerate(cfg.data.train_weights or []):
        _finite(w, f"data.train_weights[{i}]", 0)
    if cfg.objective == "dpo":
        _finite(cfg.dpo.beta, "dpo.beta", 0, low_open=True)
        _finite(cfg.dpo.gamma, "dpo.gamma", -math.inf)
        _finite(cfg.dpo.sft_weight, "dpo.sft_weight", 0)
    if cfg.lora.enabled:
        _finite(cfg.lora.alpha, "lora.alpha", 0, low_open=True)
        _finite(cfg.lora.dropout, "lora.dropout", 0, 1, high_open=True)


def validate(cfg: TrainConfig) -> None:
    """Checks that need more than types. Raises ValueError naming the key; changes nothing."""
    from models.lora import check_target_modules
    from training.reporting import check_reporters

    need = _need
    need(str(cfg.resume).lower() in RESUME_MODES, f"resume={cfg.resume} must be true, false or auto")
    need(cfg.resume_from is None or re.fullmatch(r"global_step\d+", cfg.resume_from) is not None,
         f"resume_from={cfg.resume_from} must name a checkpoint like global_step500")  # fmt: skip
    need(not cfg.overwrite_output_dir or (str(cfg.resume).lower() == "false" and not cfg.resume_from),
         "overwrite_output_dir=true starts a fresh run; it cannot be combined with resume or resume_from")  # fmt: skip
    validate_numbers(cfg)
    need(cfg.keep_last_n >= 0, f"keep_last_n={cfg.keep_last_n} must be >= 0")
    check_reporters(cfg.report_to)
    need(cfg.num_stages >= 1, f"num_stages={cfg.num_stages} must be >= 1")
    need(cfg.tensor_parallel_size >= 1, f"tensor_parallel_size={cfg.tensor_parallel_size} must be >= 1")
    need(cfg.model.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple={cfg.model.vocab_pad_multiple} must be >= 1")
    checkpoint_every(cfg.model)
    need(cfg.model.loss_chunk_size >= 0, f"model.loss_chunk_size={cfg.model.loss_chunk_size} must be >= 0")
    need(cfg.seq_length >= 2, f"seq_length={cfg.seq_length} must be >= 2")
    need(not sequence_parallel(cfg) or cfg.seq_length % cfg.tensor_parallel_size == 0,
         f"seq_length={cfg.seq_length} does not split into tensor_parallel_size={cfg.tensor_parallel_size} equal "
         "sequence shards (sequence_parallel): choose a multiple of it, or sequence_parallel=false")  # fmt: skip
    need(cfg.micro_batch_size >= 1, f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(cfg.deepspeed.zero_stage in (None, 0, 1), "deepspeed.zero_stage must be 0 or 1 with pipeline parallelism")
    need(not cfg.do_train or cfg.train_file is not None, "do_train=true needs train_file")
    weights = cfg.data.train_weights
    files = [cfg.train_file] if isinstance(cfg.train_file, str) else list(cfg.train_file or [])
    need(
        weights is None or len(weights) == len(files),
        f"data.train_weights has {len(weights or [])} entries for {len(files)} train files",
    )
    need(cfg.do_eval is not True or cfg.eval_file is not None, "do_eval=true needs eval_file")
    need(cfg.pipeline_schedule in SCHEDULES, f"pipeline_schedule={cfg.pipeline_schedule}: choose one of "
         f"{', '.join(SCHEDULES)}")  # fmt: skip
    if cfg.pipeline_schedule == "dualpipev":
        need(cfg.gradient_accumulation_steps >= 2 * cfg.num_stages,
             f"pipeline_schedule=dualpipev needs gradient_accumulation_steps >= 2 x num_stages = {2 * cfg.num_stages} "
             f"micro-batches per step, got {cfg.gradient_accumulation_steps}")  # fmt: skip
    need(not (cfg.data.packing and cfg.data.concatenate),
         "data.packing=true and data.concatenate=true: choose one (packing places whole rows, concatenation cuts "
         "the document stream into blocks)")  # fmt: skip
    need(cfg.objective in OBJECTIVES, f"objective={cfg.objective}: choose one of {', '.join(OBJECTIVES)}")
    if cfg.objective == "dpo":
        validate_dpo(cfg)
    if cfg.lora.enabled:
        need(cfg.lora.r >= 1, f"lora.r={cfg.lora.r} must be >= 1")
        need(cfg.model_name_or_path is not None, "lora.enabled=true needs model_name_or_path")
        check_target_modules(cfg.lora.target_modules)
    need(
        cfg.model_name_or_path is not None or cfg.model.hidden_size is not None,
        "model_name_or_path is not set (a checkpoint written by convert2ckpt.py) and model= names no preset to build",
    )


def validate_dpo(cfg: TrainConfig) -> None:
    """`objective=dpo` settings. Raises ValueError naming the key."""
    from models.preference import LOSS_TYPES

    d = cfg.dpo
    _need(d.loss_type in LOSS_TYPES, f"dpo.loss_type={d.loss_type}: choose one of {', '.join(LOSS_TYPES)}")
    for key in ("packing", "concatenate"):
        _need(not getattr(cfg.data, key), f"data.{key}=true: objective=dpo scores each pair's two sequences as rows "
              "of their own (packing or concatenating pairs is not supported)")  # fmt: skip
    _need(d.loss_type == "simpo" or d.reference_model is not None or cfg.model_name_or_path is not None,
          f"dpo.loss_type={d.loss_type} compares against a reference model: set model_name_or_path (the reference "
          "is the starting weights) or dpo.reference_model")  # fmt: skip


def validate_layout(cfg: TrainConfig, world_size: int, model_config) -> None:
    """The PP x TP x DP layout against the model and the launch. Raises ValueError naming the key."""
    if cfg.pipeline_schedule == "zero_bubble":
        precision, zero = resolve_precision(cfg.deepspeed.precision), resolve_zero_stage(cfg.deepspeed.zero_stage)
        _need(
            (precision, zero) == ("fp32", 0) or precision == "bf16",
            f"pipeline_schedule=zero_bubble runs with fp32 (ZeRO-0) or bf16 (ZeRO-0/1), not {precision} with "
            f"ZeRO-{zero}: that optimizer accumulates gradients in backward hooks the deferred weight gradients "
            "bypass",
        )
        _need(
            precision != "bf16" or zero == 0 or cfg.deepspeed.grad_accum_dtype in (None, "fp32"),
            f"pipeline_schedule=zero_bubble with bf16 and ZeRO-1 needs deepspeed.grad_accum_dtype=fp32, not "
            f"{cfg.deepspeed.grad_accum_dtype}: DeepSpeed's bf16 ZeRO optimizer accumulates gradients in backward "
            "hooks the deferred weight gradients bypass",
        )
    num_layers, tp = model_config.num_hidden_layers, cfg.tensor_parallel_size
    parts = None if isinstance(cfg.model.partition, str) else [int(n) for n in cfg.model.partition]
    _need(
        cfg.pipeline_schedule != "dualpipev" or parts is None or len(parts) == 2 * cfg.num_stages,
        f"model.partition={parts} has {len(parts or [])} entries; pipeline_schedule=dualpipev cuts the model into "
        f"2 x num_stages = {2 * cfg.num_stages} stages (list the decoder blocks of each)",
    )
    _need(
        cfg.pipeline_schedule != "dualpipev" or 2 * cfg.num_stages <= num_layers,
        f"pipeline_schedule=dualpipev cuts the model into 2 x num_stages = {2 * cfg.num_stages} stages, more than "
        f"its {num_layers} decoder layers",
    )
    _need(
        cfg.num_stages <= num_layers,
        f"num_stages={cfg.num_stages} is larger than the model's {num_layers} decoder layers "
        "(every stage needs at least one)",
    )
    split = f"num_stages={cfg.num_stages}" + (f" x tensor_parallel_size={tp}" if tp > 1 else "")
    _need(
        world_size % (cfg.num_stages * tp) == 0,
        f"{split} does not divide the world size {world_size} (PP x TP x DP = world size)",
    )
    bad = tp_indivisible(model_config, tp)
    _need(bad is None, f"tensor_parallel_size={tp} must divide {bad[0]}={bad[1]}" if bad else "")
