"""Typed run configuration, registered in hydra's ConfigStore so a misspelt key fails at start-up.

Precedence: dataclass defaults < `conf/*.yaml` (groups model/, data/, deepspeed/, experiment/) <
command-line overrides. The config is passed explicitly; nothing reads a global.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore

ATTN_IMPLEMENTATIONS = ("sdpa", "flash_attention_2", "eager")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
SCHEDULERS = ("cosine", "linear", "constant")


@dataclass
class ModelConfig:
    """Architecture preset and how the pipeline is built.

    The architecture fields (hidden_size ...) are None when the model comes from
    `model_name_or_path`; a preset that sets them is checked against the checkpoint's config.json
    and used to build a model from scratch when no checkpoint is given.
    """

    name: str = "from_checkpoint"
    source: str | None = None  # where the preset's numbers come from
    vocab_size: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    max_position_embeddings: int | None = None
    rms_norm_eps: float | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool | None = None
    attn_implementation: str = "sdpa"
    partition: Any = "parameters"  # "parameters", "uniform" or decoder blocks per stage, e.g. [2, 3, 3, 2]
    activation_checkpointing: bool = False


@dataclass
class DataConfig:
    text_key: str = "text"
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"  # chat rows: [{role, content}, ...] rendered with the tokenizer's chat template
    train_weights: list[float] | None = None  # one per train_file entry: mix the files by these weights
    cache_dir: str | None = None  # tokenized rows cached here (default: output_dir/data_cache; "" turns it off)
    tokenize_workers: int = 0  # tokenize in this many processes (0/1: in the rank itself)
    add_eos_to_response: bool = True  # so the model learns where an answer ends
    num_workers: int = 0


@dataclass
class DeepSpeedConfig:
    """What goes into the DeepSpeed engine config (see `training.engine.deepspeed_config`)."""

    precision: str = "auto"  # auto: bf16 on a bf16-capable GPU, fp32 on CPU
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
    lr_scheduler: str = "cosine"
    warmup_steps: int = 0
    warmup_ratio: float = 0.0  # used when warmup_steps == 0
    min_lr_ratio: float = 0.1


@dataclass
class LoraSettings:
    """LoRA adapters on the decoder layers (peft); base weights frozen, only adapters saved."""

    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class TrainConfig:
    model_name_or_path: str | None = None  # a converted pipeline checkpoint (convert2ckpt.py)
    tokenizer_name_or_path: str | None = None  # default: model_name_or_path
    output_dir: str = "outputs/run"
    num_stages: int = 1
    train_file: Any = None  # a path (.jsonl, .json, .parquet, a datasets directory) or a list of them
    eval_file: Any = None
    do_train: bool = True
    do_eval: bool = True
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
    resume: str = "false"  # true: continue from the newest checkpoint in output_dir; auto: if there is one
    nonfinite_loss: str = "stop"  # a NaN/inf loss: stop (last checkpoint kept), or skip the update and go on
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


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="deepspeed", name="deepspeed_schema", node=DeepSpeedConfig)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def validate(cfg: TrainConfig) -> None:
    """Checks that need more than types. Raises ValueError naming the key. Normalises `resume`."""
    need = _need
    cfg.resume = str(cfg.resume).lower()
    need(cfg.resume in ("true", "false", "auto"), f"resume={cfg.resume} must be true, false or auto")
    need(cfg.keep_last_n >= 0, f"keep_last_n={cfg.keep_last_n} must be >= 0")
    from training.reporting import check_reporters

    check_reporters(cfg.report_to)
    need(cfg.nonfinite_loss in ("stop", "skip"), f"nonfinite_loss={cfg.nonfinite_loss} must be stop or skip")
    need(cfg.dist_timeout_minutes > 0, f"dist_timeout_minutes={cfg.dist_timeout_minutes} must be > 0")
    need(cfg.num_stages >= 1, f"num_stages={cfg.num_stages} must be >= 1")
    need(cfg.seq_length >= 2, f"seq_length={cfg.seq_length} must be >= 2")
    need(cfg.micro_batch_size >= 1, f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(cfg.learning_rate >= 0, f"learning_rate={cfg.learning_rate} must be >= 0")
    need(
        cfg.model.attn_implementation in ATTN_IMPLEMENTATIONS,
        f"model.attn_implementation must be one of {ATTN_IMPLEMENTATIONS}",
    )
    need(cfg.deepspeed.precision in PRECISIONS, f"deepspeed.precision must be one of {PRECISIONS}")
    need(cfg.optim.lr_scheduler in SCHEDULERS, f"optim.lr_scheduler must be one of {SCHEDULERS}")
    need(cfg.deepspeed.zero_stage in (None, 0, 1), "deepspeed.zero_stage must be 0 or 1 with pipeline parallelism")
    need(not cfg.do_train or cfg.train_file is not None, "do_train=true needs train_file")
    weights = cfg.data.train_weights
    files = [cfg.train_file] if isinstance(cfg.train_file, str) else list(cfg.train_file or [])
    need(
        weights is None or len(weights) == len(files),
        f"data.train_weights has {len(weights or [])} entries for {len(files)} train files",
    )
    need(not cfg.do_eval or cfg.eval_file is not None, "do_eval=true needs eval_file")
    need(not cfg.lora.enabled or cfg.lora.r >= 1, f"lora.r={cfg.lora.r} must be >= 1")
    need(not cfg.lora.enabled or cfg.model_name_or_path is not None, "lora.enabled=true needs model_name_or_path")
    need(
        cfg.model_name_or_path is not None or cfg.model.hidden_size is not None,
        "model_name_or_path is not set (a checkpoint written by convert2ckpt.py) and model= names no preset to build",
    )


def validate_layout(cfg: TrainConfig, world_size: int, num_layers: int) -> None:
    """The PP x DP layout against the model and the launch. Raises ValueError naming the key."""
    _need(
        cfg.num_stages <= num_layers,
        f"num_stages={cfg.num_stages} is larger than the model's {num_layers} decoder layers "
        "(every stage needs at least one)",
    )
    _need(
        world_size % cfg.num_stages == 0,
        f"num_stages={cfg.num_stages} does not divide the world size {world_size} (PP x DP = world size)",
    )


def check_overrides(args: list[str], conf_dir: str) -> str | None:
    """A one-line problem with a command-line override (unknown key, wrong type, unknown preset), or None.

    Hydra reports these as multi-line messages after composing; checking first gives the key, the
    reason and a close match.
    """
    import difflib

    from omegaconf import OmegaConf

    schema = OmegaConf.structured(TrainConfig)
    keys = [k for k, _ in _dotted(OmegaConf.to_container(schema))]
    groups = {g for g in os.listdir(conf_dir) if os.path.isdir(os.path.join(conf_dir, g))}
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if key.startswith(("hydra", "+", "~")):
            continue
        if key in groups and not ("." in value or value.startswith("{")):
            presets = sorted(f[:-5] for f in os.listdir(os.path.join(conf_dir, key)) if f.endswith(".yaml"))
            if value not in presets and value != "null":
                return f"{key}={value}: unknown preset (conf/{key}/ has {', '.join(presets)})"
            continue
        sweep = ("," in value and not value.startswith(("[", "{", "'", '"'))) or value.startswith(
            ("range(", "choice(", "interval(", "glob(")
        )  # a multirun sweep (`-m learning_rate=1e-4,3e-4`): hydra checks each value
        if sweep and (key in keys or key in groups):
            continue
        try:
            OmegaConf.merge(schema, OmegaConf.from_dotlist([arg]))
        except Exception as e:  # noqa: BLE001 - omegaconf's key, type and grammar errors
            if key not in keys and not any(k.startswith(key + ".") for k in keys):
                close = difflib.get_close_matches(key, keys, n=1)
                return f"{key}: unknown config key" + (f" (did you mean {close[0]}?)" if close else "")
            reason = str(e).strip().splitlines()[0]
            return f"{arg}: {reason}"
    return None


def _dotted(tree: dict, prefix: str = ""):
    for k, v in tree.items():
        yield prefix + k, v
        if isinstance(v, dict):
            yield from _dotted(v, prefix + k + ".")
