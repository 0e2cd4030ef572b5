"""The checks of a run config that need nothing but the config: numbers in range, keys that exclude each other,
what each objective needs. Each raises ValueError with one line naming the key. Types, unknown keys and the choices
of enum keys are checked earlier, when the config is composed (schema/compose.py); the checks against the model and
the launch are training/validate.py's. Nothing here changes the config.
"""

from __future__ import annotations

import math
import re

from schema.model import checkpoint_every
from schema.train import RESUME_MODES, TrainConfig, min_micro_batches

REPORTERS = ("tensorboard", "wandb")


def check_reporters(report_to: list[str]) -> None:
    """Raise ValueError naming an unknown or missing reporter, before any training starts."""
    for name in report_to:
        if name not in REPORTERS:
            raise ValueError(f"report_to: unknown reporter {name!r} (choose from {', '.join(REPORTERS)})")
        module = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}[name]
        try:
            __import__(module)
        except ImportError:
            package = "tensorboard" if name == "tensorboard" else "wandb"
            raise ValueError(f"report_to: {name} needs the '{package}' package (pip install {package})") from None


def need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def finite(value, key: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """`key`=`value` must be a finite number in the range; ValueError naming both otherwise."""
    lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
    bounds = f"{lo}{low:g}, {'inf' if math.isinf(high) else f'{high:g}'}{hi}"
    ok = isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    need(ok, f"{key}={value} must be a finite number in {bounds}")


def check_numbers(cfg: TrainConfig) -> None:
    """Every numeric setting finite and in range, so none trains into NaN weights or a wrong schedule."""
    o = cfg.optim
    finite(cfg.learning_rate, "learning_rate", 0)
    finite(o.weight_decay, "optim.weight_decay", 0)
    finite(o.beta1, "optim.beta1", 0, 1, high_open=True)
    finite(o.beta2, "optim.beta2", 0, 1, high_open=True)
    finite(o.eps, "optim.eps", 0, low_open=True)
    finite(o.max_grad_norm, "optim.max_grad_norm", 0)
    finite(o.warmup_ratio, "optim.warmup_ratio", 0, 1)
    finite(o.min_lr_ratio, "optim.min_lr_ratio", 0, 1)
    need(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    finite(o.muon_momentum, "optim.muon_momentum", 0, 1, high_open=True)
    need(1 <= o.muon_ns_steps < 100, f"optim.muon_ns_steps={o.muon_ns_steps} must be in [1, 99]")
    finite(cfg.dist_timeout_minutes, "dist_timeout_minutes", 0, low_open=True)
    finite(cfg.dist_init_timeout_minutes, "dist_init_timeout_minutes", 0, low_open=True)
    need(cfg.max_steps >= -1, f"max_steps={cfg.max_steps} must be -1 (use num_train_epochs) or a step count")
    need(cfg.num_train_epochs >= 1 or cfg.max_steps > 0, f"num_train_epochs={cfg.num_train_epochs} must be >= 1")
    for key in ("save_steps", "eval_steps"):
        need(getattr(cfg, key) >= 0, f"{key}={getattr(cfg, key)} must be >= 0")
    need(cfg.logging_steps >= 1, f"logging_steps={cfg.logging_steps} must be >= 1")
    need(
        cfg.eval_micro_batch_size is None or cfg.eval_micro_batch_size >= 1,
        f"eval_micro_batch_size={cfg.eval_micro_batch_size} must be >= 1",
    )
    need(cfg.deepspeed.steps_per_print >= 1, f"deepspeed.steps_per_print={cfg.deepspeed.steps_per_print} must be >= 1")
    need(
        0 <= cfg.deepspeed.initial_scale_power <= 32,
        f"deepspeed.initial_scale_power={cfg.deepspeed.initial_scale_power} must be in [0, 32]",
    )
    for key in ("tokenize_workers", "num_workers"):
        need(getattr(cfg.data, key) >= 0, f"data.{key}={getattr(cfg.data, key)} must be >= 0")
    for i, w in enumerate(cfg.data.train_weights or []):
        finite(w, f"data.train_weights[{i}]", 0)
    if cfg.objective == "dpo":
        finite(cfg.dpo.beta, "dpo.beta", 0, low_open=True)
        finite(cfg.dpo.gamma, "dpo.gamma", -math.inf)
        finite(cfg.dpo.sft_weight, "dpo.sft_weight", 0)
    if cfg.lora.enabled:
        finite(cfg.lora.alpha, "lora.alpha", 0, low_open=True)
        finite(cfg.lora.dropout, "lora.dropout", 0, 1, high_open=True)


def check_config(cfg: TrainConfig) -> None:
    """Checks that need more than types and nothing but the config (`data.prepare` runs them as they are; the
    trainer adds those that depend on the model and the machine: training/validate.py). Raises ValueError naming
    the key; changes nothing."""
    need(str(cfg.resume).lower() in RESUME_MODES, f"resume={cfg.resume} must be true, false or auto")
    need(
        cfg.resume_from is None or re.fullmatch(r"global_step\d+", cfg.resume_from) is not None,
        f"resume_from={cfg.resume_from} must name a checkpoint like global_step500",
    )
    need(
        not cfg.overwrite_output_dir or (str(cfg.resume).lower() == "false" and not cfg.resume_from),
        "overwrite_output_dir=true starts a fresh run; it cannot be combined with resume or resume_from",
    )
    check_numbers(cfg)
    need(cfg.keep_last_n >= 0, f"keep_last_n={cfg.keep_last_n} must be >= 0")
    check_reporters(cfg.report_to)
    need(cfg.num_stages >= 1, f"num_stages={cfg.num_stages} must be >= 1")
    need(cfg.tensor_parallel_size >= 1, f"tensor_parallel_size={cfg.tensor_parallel_size} must be >= 1")
    need(cfg.context_parallel_size >= 1, f"context_parallel_size={cfg.context_parallel_size} must be >= 1")
    need(cfg.model.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple={cfg.model.vocab_pad_multiple} must be >= 1")
    checkpoint_every(cfg.model)
    need(cfg.model.loss_chunk_size >= 0, f"model.loss_chunk_size={cfg.model.loss_chunk_size} must be >= 0")
    check_mlp_tiles(cfg)
    need(cfg.seq_length >= 2, f"seq_length={cfg.seq_length} must be >= 2")
    need(cfg.micro_batch_size >= 1, f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(cfg.deepspeed.zero_stage in (None, 0, 1), "deepspeed.zero_stage must be 0 or 1 with pipeline parallelism")
    need(
        cfg.tokenizer_name_or_path is not None or cfg.model_name_or_path is not None,
        "tokenizer_name_or_path (or model_name_or_path) is not set",
    )
    need(not cfg.do_train or cfg.train_file is not None, "do_train=true needs train_file")
    weights = cfg.data.train_weights
    files = [cfg.train_file] if isinstance(cfg.train_file, str) else list(cfg.train_file or [])
    need(
        weights is None or len(weights) == len(files),
        f"data.train_weights has {len(weights or [])} entries for {len(files)} train files",
    )
    need(cfg.do_eval is not True or cfg.eval_file is not None, "do_eval=true needs eval_file")
    least = min_micro_batches(cfg.pipeline_schedule, cfg.num_stages)
    need(
        cfg.gradient_accumulation_steps >= least,
        f"pipeline_schedule=dualpipev needs gradient_accumulation_steps >= 2 x num_stages = {least} "
        f"micro-batches per step, got {cfg.gradient_accumulation_steps}",
    )
    need(
        not (cfg.data.packing and cfg.data.concatenate),
        "data.packing=true and data.concatenate=true: choose one (packing places whole rows, concatenation cuts "
        "the document stream into blocks)",
    )
    if cfg.objective == "dpo":
        check_dpo(cfg)
    if cfg.lora.enabled:
        need(cfg.lora.r >= 1, f"lora.r={cfg.lora.r} must be >= 1")
        need(cfg.model_name_or_path is not None, "lora.enabled=true needs model_name_or_path")
        # lora.target_modules: checked against the family's own layers once its config is read (validate_layout)
    need(cfg.lora.quantize in ("none", "nf4"), f"lora.quantize={cfg.lora.quantize} must be none or nf4")
    need(
        cfg.lora.quantize == "none" or cfg.lora.enabled,
        f"lora.quantize={cfg.lora.quantize} needs lora.enabled=true: only a LoRA run's base is frozen",
    )
    need(
        not cfg.lora.quantize_double or cfg.lora.quantize == "nf4",
        "lora.quantize_double=true needs lora.quantize=nf4",
    )
    need(not cfg.lora.keep_quantized or cfg.lora.enabled, "lora.keep_quantized=true needs lora.enabled=true")
    need(
        not cfg.lora.keep_quantized or cfg.lora.quantize == "none",
        f"lora.keep_quantized=true with lora.quantize={cfg.lora.quantize}: the base is either the hub's or NF4",
    )
    need(
        cfg.model_name_or_path is not None or cfg.model.hidden_size is not None,
        "model_name_or_path is not set (a checkpoint written by convert2ckpt.py) and model= names no preset to build",
    )


def check_dpo(cfg: TrainConfig) -> None:
    """`objective=dpo` settings. Raises ValueError naming the key."""
    d = cfg.dpo
    for key in ("packing", "concatenate"):
        need(
            not getattr(cfg.data, key),
            f"data.{key}=true: objective=dpo scores each pair's two sequences as rows "
            "of their own (packing or concatenating pairs is not supported)",
        )
    need(
        d.loss_type == "simpo" or d.reference_model is not None or cfg.model_name_or_path is not None,
        f"dpo.loss_type={d.loss_type} compares against a reference model: set model_name_or_path (the reference "
        "is the starting weights) or dpo.reference_model",
    )


def check_mlp_tiles(cfg: TrainConfig) -> None:
    """`model.mlp_tiles` (DeepSpeed's TiledMLP, models/context_parallel.tile_mlp) and what it cannot run with."""
    tiles = cfg.model.mlp_tiles
    need(tiles >= 0, f"model.mlp_tiles={tiles} must be >= 0")
    if tiles <= 1:
        return
    need(
        cfg.pipeline_schedule != "zero_bubble",
        f"model.mlp_tiles={tiles} with pipeline_schedule=zero_bubble: TiledMLP takes its weights' gradients inside "
        "its own backward, where they cannot be deferred; use 1f1b or dualpipev",
    )
    need(
        cfg.tensor_parallel_size == 1,
        f"model.mlp_tiles={tiles} with tensor_parallel_size={cfg.tensor_parallel_size}: under sequence parallelism "
        "each tile's output would be reduce-scattered over the TP ranks on its own, not the row's, and without it "
        "tiles under TP are not proven here; split long rows with context_parallel_size instead",
    )
