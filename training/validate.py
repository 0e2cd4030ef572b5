"""Every check of a run config's values, in one place: `validate` (before anything is read or built) and
`validate_layout` (once the model's config is known). Each raises ValueError with one line naming the key.

Types, unknown keys and the choices of enum keys are checked earlier, when hydra composes the config
(training/cli.py). Nothing here changes the config.
"""

from __future__ import annotations

import math
import re

from models.config import checkpoint_every
from models.families import FAMILIES, family_of, linear_attention_refusal, tp_refusal
from models.lora import check_target_modules, lora_tp_refusal
from models.moe import is_moe, num_experts
from models.sharding import tp_indivisible
from models.tp_rules import replicated_expert_tensors
from training.config import (
    RESUME_MODES,
    DeepSpeedConfig,
    TrainConfig,
    min_micro_batches,
    model_stages,
)
from training.precision import is_resolved, resolved
from training.reporting import check_reporters


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
    _finite(cfg.dist_init_timeout_minutes, "dist_init_timeout_minutes", 0, low_open=True)
    _need(cfg.max_steps >= -1, f"max_steps={cfg.max_steps} must be -1 (use num_train_epochs) or a step count")
    _need(cfg.num_train_epochs >= 1 or cfg.max_steps > 0, f"num_train_epochs={cfg.num_train_epochs} must be >= 1")
    for key in ("save_steps", "eval_steps"):
        _need(getattr(cfg, key) >= 0, f"{key}={getattr(cfg, key)} must be >= 0")
    _need(cfg.logging_steps >= 1, f"logging_steps={cfg.logging_steps} must be >= 1")
    _need(
        cfg.eval_micro_batch_size is None or cfg.eval_micro_batch_size >= 1,
        f"eval_micro_batch_size={cfg.eval_micro_batch_size} must be >= 1",
    )
    _need(cfg.deepspeed.steps_per_print >= 1, f"deepspeed.steps_per_print={cfg.deepspeed.steps_per_print} must be >= 1")
    _need(
        0 <= cfg.deepspeed.initial_scale_power <= 32,
        f"deepspeed.initial_scale_power={cfg.deepspeed.initial_scale_power} must be in [0, 32]",
    )
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


def validate(cfg: TrainConfig, training_here: bool = True) -> None:
    """Checks that need more than types. Raises ValueError naming the key; changes nothing.

    Args:
        training_here: also check what depends on this machine's accelerator (precision and ZeRO stage as it
            resolves them); false for `data.prepare`, which may run on a CPU box for a GPU run.
    """
    need = _need
    need(str(cfg.resume).lower() in RESUME_MODES, f"resume={cfg.resume} must be true, false or auto")
    need(
        cfg.resume_from is None or re.fullmatch(r"global_step\d+", cfg.resume_from) is not None,
        f"resume_from={cfg.resume_from} must name a checkpoint like global_step500",
    )
    need(
        not cfg.overwrite_output_dir or (str(cfg.resume).lower() == "false" and not cfg.resume_from),
        "overwrite_output_dir=true starts a fresh run; it cannot be combined with resume or resume_from",
    )
    validate_numbers(cfg)
    need(cfg.keep_last_n >= 0, f"keep_last_n={cfg.keep_last_n} must be >= 0")
    check_reporters(cfg.report_to)
    need(cfg.num_stages >= 1, f"num_stages={cfg.num_stages} must be >= 1")
    need(cfg.tensor_parallel_size >= 1, f"tensor_parallel_size={cfg.tensor_parallel_size} must be >= 1")
    need(cfg.context_parallel_size >= 1, f"context_parallel_size={cfg.context_parallel_size} must be >= 1")
    need(cfg.model.vocab_pad_multiple >= 1, f"model.vocab_pad_multiple={cfg.model.vocab_pad_multiple} must be >= 1")
    checkpoint_every(cfg.model)
    need(cfg.model.loss_chunk_size >= 0, f"model.loss_chunk_size={cfg.model.loss_chunk_size} must be >= 0")
    validate_mlp_tiles(cfg)
    need(cfg.seq_length >= 2, f"seq_length={cfg.seq_length} must be >= 2")
    need(cfg.micro_batch_size >= 1, f"micro_batch_size={cfg.micro_batch_size} must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1")
    need(cfg.deepspeed.zero_stage in (None, 0, 1), "deepspeed.zero_stage must be 0 or 1 with pipeline parallelism")
    if training_here:  # the config as this machine will resolve it (training/precision.py)
        ds = resolved(cfg.deepspeed)
        validate_offload(ds)
        validate_bf16_gradients(ds)
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
        validate_dpo(cfg)
    if cfg.lora.enabled:
        need(cfg.lora.r >= 1, f"lora.r={cfg.lora.r} must be >= 1")
        need(cfg.model_name_or_path is not None, "lora.enabled=true needs model_name_or_path")
        # lora.target_modules: checked against the family's own layers once its config is read (validate_layout)
    need(
        cfg.model_name_or_path is not None or cfg.model.hidden_size is not None,
        "model_name_or_path is not set (a checkpoint written by convert2ckpt.py) and model= names no preset to build",
    )


def validate_dpo(cfg: TrainConfig) -> None:
    """`objective=dpo` settings. Raises ValueError naming the key."""
    d = cfg.dpo
    for key in ("packing", "concatenate"):
        _need(
            not getattr(cfg.data, key),
            f"data.{key}=true: objective=dpo scores each pair's two sequences as rows "
            "of their own (packing or concatenating pairs is not supported)",
        )
    _need(
        d.loss_type == "simpo" or d.reference_model is not None or cfg.model_name_or_path is not None,
        f"dpo.loss_type={d.loss_type} compares against a reference model: set model_name_or_path (the reference "
        "is the starting weights) or dpo.reference_model",
    )


def validate_layout(cfg: TrainConfig, world_size: int, model_config) -> None:
    """The PP x TP x DP layout against the model and the launch (`cfg` resolved: training/precision.py). Raises
    ValueError naming the key."""
    if not is_resolved(cfg.deepspeed):
        raise ValueError("validate_layout checks the resolved config (training.precision.resolve)")
    if cfg.pipeline_schedule == "zero_bubble":
        precision, zero = cfg.deepspeed.precision, cfg.deepspeed.zero_stage
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
    stages = model_stages(cfg.pipeline_schedule, cfg.num_stages)
    _need(
        cfg.pipeline_schedule != "dualpipev" or parts is None or len(parts) == stages,
        f"model.partition={parts} has {len(parts or [])} entries; pipeline_schedule=dualpipev cuts the model into "
        f"2 x num_stages = {stages} stages (list the decoder blocks of each)",
    )
    _need(
        stages <= num_layers or cfg.pipeline_schedule != "dualpipev",
        f"pipeline_schedule=dualpipev cuts the model into 2 x num_stages = {stages} stages, more than "
        f"its {num_layers} decoder layers",
    )
    _need(
        cfg.num_stages <= num_layers,
        f"num_stages={cfg.num_stages} is larger than the model's {num_layers} decoder layers "
        "(every stage needs at least one)",
    )
    cp = cfg.context_parallel_size
    split = f"num_stages={cfg.num_stages}" + (f" x tensor_parallel_size={tp}" if tp > 1 else "")
    split += f" x context_parallel_size={cp}" if cp > 1 else ""
    _need(
        world_size % (cfg.num_stages * tp * cp) == 0,
        f"{split} does not divide the world size {world_size} (PP x TP x CP x DP = world size)",
    )
    refused = tp_refusal(model_config, tp)
    _need(refused is None, f"tensor_parallel_size={tp}: {refused}")
    bad = tp_indivisible(model_config, tp)
    _need(bad is None, f"tensor_parallel_size={tp} must divide {bad[0]}={bad[1]}" if bad else "")
    if cfg.lora.enabled and not is_moe(model_config):  # the family's own linear layers (fused: qkv_proj, ...)
        check_target_modules(cfg.lora.target_modules, model_config)
    refused = lora_tp_refusal(model_config) if cfg.lora.enabled and tp > 1 else None
    _need(refused is None, f"lora.enabled with tensor_parallel_size={tp}: {refused}")
    validate_context_parallel(cfg, model_config)
    validate_expert_parallel(cfg, world_size, model_config)
    cp, shared = cfg.context_parallel_size, cfg.data.documents_share_rows
    for what, on in ((f"context_parallel_size={cp}", cp > 1), ("data.packing/concatenate", shared)):
        refusal = linear_attention_refusal(model_config, what) if on else None
        _need(refusal is None, refusal or "")
    if is_moe(model_config):
        validate_experts(cfg, model_config)
    else:
        rate = cfg.moe.bias_update_rate
        _need(not rate, f"moe.bias_update_rate={rate}: the model ({model_config.model_type}) has no experts")


def validate_mlp_tiles(cfg: TrainConfig) -> None:
    """`model.mlp_tiles` (DeepSpeed's TiledMLP, models/context_parallel.tile_mlp) and what it cannot run with."""
    tiles = cfg.model.mlp_tiles
    _need(tiles >= 0, f"model.mlp_tiles={tiles} must be >= 0")
    if tiles <= 1:
        return
    _need(
        cfg.pipeline_schedule != "zero_bubble",
        f"model.mlp_tiles={tiles} with pipeline_schedule=zero_bubble: TiledMLP takes its weights' gradients inside "
        "its own backward, where they cannot be deferred; use 1f1b or dualpipev",
    )
    _need(
        cfg.tensor_parallel_size == 1,
        f"model.mlp_tiles={tiles} with tensor_parallel_size={cfg.tensor_parallel_size}: under sequence parallelism "
        "each tile's output would be reduce-scattered over the TP ranks on its own, not the row's, and without it "
        "tiles under TP are not proven here; split long rows with context_parallel_size instead",
    )


def validate_context_parallel(cfg: TrainConfig, model_config) -> None:
    """context_parallel_size against the model: Ulysses splits each TP rank's heads over the C ranks."""
    cp = cfg.context_parallel_size
    if cp == 1:
        return
    heads = model_config.num_attention_heads // cfg.tensor_parallel_size
    kv = model_config.num_key_value_heads // cfg.tensor_parallel_size
    per_tp = " per tensor-parallel rank" if cfg.tensor_parallel_size > 1 else ""
    _need(
        heads % cp == 0,
        f"context_parallel_size={cp} must divide the model's {heads} attention heads{per_tp} (num_attention_heads="
        f"{model_config.num_attention_heads}): each CP rank attends with heads / C of them",
    )
    _need(
        kv % cp == 0 or cp % kv == 0,
        f"context_parallel_size={cp} and the model's {kv} key/value heads{per_tp} (num_key_value_heads="
        f"{model_config.num_key_value_heads}): one must divide the other (fewer KV heads than C are replicated)",
    )


def validate_expert_parallel(cfg: TrainConfig, world_size: int, model_config) -> None:
    """expert_parallel_size against the model and the layout."""
    ep = cfg.expert_parallel_size
    _need(ep >= 1, f"expert_parallel_size={ep} must be >= 1")
    if ep == 1:
        return
    _need(is_moe(model_config), f"expert_parallel_size={ep}: the model ({model_config.model_type}) has no experts")
    # The experts split over consecutive ranks of a stage's data axis: its DP replicas and, inside each, its CP ranks
    # (training/topology.py), which route their own positions' tokens alike.
    cp = cfg.context_parallel_size
    dp = world_size // (cfg.num_stages * cfg.tensor_parallel_size * cp)
    ranks = f"data-parallel size {dp}" if cp == 1 else f"{dp * cp} data ranks (DP={dp} x CP={cp})"
    _need((dp * cp) % ep == 0, f"expert_parallel_size={ep} does not divide the {ranks} of each stage")
    tp = cfg.tensor_parallel_size
    whole = replicated_expert_tensors(model_config) if tp > 1 else []
    _need(
        not whole,
        f"tensor_parallel_size={tp} with expert_parallel_size={ep}: {model_config.model_type}'s experts hold "
        f"{whole[0] if whole else ''} whole on every tensor-parallel rank, and the norm of the expert gradients would "
        "count it once per rank (not built); use tensor or expert parallelism, not both",
    )
    experts = num_experts(model_config)
    _need(experts % ep == 0, f"expert_parallel_size={ep} does not divide the model's {experts} experts")
    precision = cfg.deepspeed.precision
    _need(
        precision != "fp16",
        f"expert_parallel_size={ep} runs with fp32 or bf16, not fp16: DeepSpeed's fp16 optimizer with experts is "
        "not proven here (no fp16 on CPU ranks)",
    )
    _need(
        not cfg.deepspeed.offload_optimizer,
        f"expert_parallel_size={ep} with deepspeed.offload_optimizer=true is not supported: ZeRO-Offload's CPU "
        "optimizer with experts is not proven here",
    )


def balanced_families() -> list[str]:
    """The families whose router chooses experts by its scores plus a score bias (`MoeSpec.score_bias`)."""
    return [name for name, family in FAMILIES.items() if family.moe is not None and family.moe.score_bias]


def validate_experts(cfg: TrainConfig, model_config) -> None:
    """A model with experts: routing that transformers computes and we reproduce exactly, never approximated."""
    jitter = getattr(model_config, "router_jitter_noise", 0.0) or 0.0
    _need(
        jitter == 0.0,
        f"router_jitter_noise={jitter} in the model's config.json: random multiplicative noise on the router's "
        "input cannot be reproduced exactly (set it to 0.0)",
    )
    if cfg.lora.enabled:
        check_target_modules(cfg.lora.target_modules, model_config)
    _need(
        cfg.moe.aux_loss_coef is None or cfg.moe.aux_loss_coef >= 0,
        f"moe.aux_loss_coef={cfg.moe.aux_loss_coef} must be >= 0",
    )
    rate = cfg.moe.bias_update_rate
    _need(rate >= 0, f"moe.bias_update_rate={rate} must be >= 0")
    _need(
        not (rate and cfg.lora.enabled),
        f"moe.bias_update_rate={rate} with lora.enabled=true: --merge-lora exports the base model's score biases, "
        "not the balanced ones; balance without LoRA",
    )
    _need(
        not rate or family_of(model_config).moe.score_bias,
        f"moe.bias_update_rate={rate}: {model_config.model_type}'s router has no score bias to balance with "
        f"(a router that chooses by scores plus e_score_correction_bias: {', '.join(balanced_families())}); leave it 0",
    )
    if family_of(model_config).moe.aux_loss:
        return
    name = model_config.model_type
    _need(
        not cfg.moe.aux_loss_coef,
        f"moe.aux_loss_coef={cfg.moe.aux_loss_coef}: transformers trains {name} with no load-balancing loss (its "
        "sigmoid router has none to reproduce); leave it 0",
    )
    if not getattr(model_config, "attn_temperature_tuning", False):  # Llama 4's NoPE layers
        return
    _need(
        not (cfg.data.documents_share_rows and cfg.seq_length > model_config.floor_scale),
        f"data.packing/concatenate with seq_length={cfg.seq_length} > floor_scale={model_config.floor_scale}: "
        f"{name}'s attention temperature counts positions from the row's start, not each document's (transformers "
        "ignores position_ids there); use rows of at most floor_scale tokens or unpacked rows",
    )


def validate_bf16_gradients(ds: DeepSpeedConfig) -> None:
    """bf16 weights with fp32 gradients: only DeepSpeed's ZeRO-1 path keeps them (0.19.8,
    `DeepSpeedEngine._do_optimizer_sanity_check`, a NotImplementedError traceback otherwise). `ds`: resolved."""
    _need(
        ds.precision != "bf16" or ds.zero_stage >= 1 or ds.grad_accum_dtype == "bf16",
        f"deepspeed.zero_stage=0 with bf16 needs deepspeed.grad_accum_dtype=bf16, not {ds.grad_accum_dtype or 'fp32'}: "
        "DeepSpeed keeps fp32 gradients for bf16 weights only with ZeRO-1 (deepspeed=bf16_zero1)",
    )


def validate_offload(ds: DeepSpeedConfig) -> None:
    """Optimizer offload under the pipeline engine, with the precision and ZeRO stage this machine resolves (`ds`)."""
    if not ds.offload_optimizer:
        return
    _need(
        ds.precision != "bf16",
        "deepspeed.offload_optimizer=true with bf16 is not supported by DeepSpeed's pipeline engine "
        "(DeepSpeed issue 3866); use deepspeed=fp16_offload",
    )
    _need(ds.zero_stage >= 1, "deepspeed.offload_optimizer=true needs deepspeed.zero_stage=1")
