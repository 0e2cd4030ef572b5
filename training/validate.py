"""The trainer's checks of a run config: `validate` (before anything is read or built: schema/checks.py's checks of
the config alone, and what this machine resolves) and `validate_layout` (once the model's config is known, against
the launch). Each raises ValueError with one line naming the key. Nothing here changes the config.
"""

from __future__ import annotations

import re

from checkpoint.kept_quantized import keep_quantized_refusal
from models.families import FAMILIES, family_of, tp_refusal
from models.hub_names import memory_key
from models.key_table import all_layer_keys
from models.layer_config import layer_attr
from models.layer_kinds import linear_attention_refusal
from models.lora import check_target_modules, lora_tp_refusal
from models.moe import is_moe, num_experts
from models.nf4 import nf4_refusal, require_bitsandbytes
from models.sharding import tp_indivisible
from schema.checks import check_config, need
from schema.model import checkpoint_every
from schema.train import DeepSpeedConfig, TrainConfig, model_stages
from training.precision import is_resolved, resolved


def validate(cfg: TrainConfig, training_here: bool = True) -> None:
    """Checks that need more than types (schema/checks.py `check_config`). Raises ValueError naming the key.

    Args:
        training_here: also check what depends on this machine's accelerator (precision and ZeRO stage as it
            resolves them).
    """
    check_config(cfg)
    if training_here:  # the config as this machine will resolve it (training/precision.py)
        ds = resolved(cfg.deepspeed)
        validate_offload(ds)
        validate_bf16_gradients(ds)
        validate_optimizer(cfg, ds)


def validate_layout(cfg: TrainConfig, world_size: int, model_config) -> None:
    """The PP x TP x DP layout against the model and the launch (`cfg` resolved: training/precision.py). Raises
    ValueError naming the key."""
    if not is_resolved(cfg.deepspeed):
        raise ValueError("validate_layout checks the resolved config (training.precision.resolve)")
    if cfg.pipeline_schedule == "zero_bubble":
        precision, zero = cfg.deepspeed.precision, cfg.deepspeed.zero_stage
        need(
            (precision, zero) == ("fp32", 0) or precision == "bf16",
            f"pipeline_schedule=zero_bubble runs with fp32 (ZeRO-0) or bf16 (ZeRO-0/1), not {precision} with "
            f"ZeRO-{zero}: that optimizer accumulates gradients in backward hooks the deferred weight gradients "
            "bypass",
        )
        need(
            precision != "bf16" or zero == 0 or cfg.deepspeed.grad_accum_dtype in (None, "fp32"),
            f"pipeline_schedule=zero_bubble with bf16 and ZeRO-1 needs deepspeed.grad_accum_dtype=fp32, not "
            f"{cfg.deepspeed.grad_accum_dtype}: DeepSpeed's bf16 ZeRO optimizer accumulates gradients in backward "
            "hooks the deferred weight gradients bypass",
        )
    num_layers, tp = model_config.num_hidden_layers, cfg.tensor_parallel_size
    parts = None if isinstance(cfg.model.partition, str) else [int(n) for n in cfg.model.partition]
    stages = model_stages(cfg.pipeline_schedule, cfg.num_stages)
    need(
        cfg.pipeline_schedule != "dualpipev" or parts is None or len(parts) == stages,
        f"model.partition={parts} has {len(parts or [])} entries; pipeline_schedule=dualpipev cuts the model into "
        f"2 x num_stages = {stages} stages (list the decoder blocks of each)",
    )
    need(
        stages <= num_layers or cfg.pipeline_schedule != "dualpipev",
        f"pipeline_schedule=dualpipev cuts the model into 2 x num_stages = {stages} stages, more than "
        f"its {num_layers} decoder layers",
    )
    need(
        cfg.num_stages <= num_layers,
        f"num_stages={cfg.num_stages} is larger than the model's {num_layers} decoder layers "
        "(every stage needs at least one)",
    )
    cp = cfg.context_parallel_size
    split = f"num_stages={cfg.num_stages}" + (f" x tensor_parallel_size={tp}" if tp > 1 else "")
    split += f" x context_parallel_size={cp}" if cp > 1 else ""
    need(
        world_size % (cfg.num_stages * tp * cp) == 0,
        f"{split} does not divide the world size {world_size} (PP x TP x CP x DP = world size)",
    )
    refused = tp_refusal(model_config, tp)
    need(refused is None, f"tensor_parallel_size={tp}: {refused}")
    bad = tp_indivisible(model_config, tp)
    need(bad is None, f"tensor_parallel_size={tp} must divide {bad[0]}={bad[1]}" if bad else "")
    if cfg.lora.enabled and not is_moe(model_config):  # the family's own linear layers (fused: qkv_proj, ...)
        check_target_modules(cfg.lora.target_modules, model_config)
    refused = lora_tp_refusal(model_config) if cfg.lora.enabled and tp > 1 else None
    need(refused is None, f"lora.enabled with tensor_parallel_size={tp}: {refused}")
    if cfg.lora.quantize == "nf4":
        require_bitsandbytes()
        refused = nf4_refusal(model_config)
        need(refused is None, f"lora.quantize=nf4: {refused}")
        need(
            not (cfg.lora.quantize_experts and is_moe(model_config)) or checkpoint_every(cfg.model) == 1,
            "lora.quantize=nf4 on a model with experts needs model.activation_checkpointing=true (each layer's "
            "experts are dequantized for its forward; without recompute backward would keep every layer's), or "
            "lora.quantize_experts=false",
        )
    if cfg.lora.keep_quantized:
        refused = keep_quantized_refusal(cfg.model_name_or_path, tp)
        need(refused is None, f"lora.keep_quantized=true: {refused}")
        need(
            not is_moe(model_config) or checkpoint_every(cfg.model) == 1,
            "lora.keep_quantized=true on a model with experts needs model.activation_checkpointing=true (each "
            "layer's experts are dequantized for its forward; without recompute backward would keep every layer's)",
        )
    validate_context_parallel(cfg, model_config)
    validate_expert_parallel(cfg, world_size, model_config)
    validate_fp16(cfg, model_config)
    cp, shared = cfg.context_parallel_size, cfg.data.documents_share_rows
    for what, on in ((f"context_parallel_size={cp}", cp > 1), ("data.packing/concatenate", shared)):
        refusal = linear_attention_refusal(model_config, what) if on else None
        need(refusal is None, refusal or "")
    reason = family_of(model_config).cp_refused
    need(cp == 1 or not reason, f"context_parallel_size={cp}: {model_config.model_type}'s {reason}" if reason else "")
    reason = family_of(model_config).packing_refused
    need(
        not shared or not reason,
        f"data.packing/concatenate: {model_config.model_type}'s {reason}; pad each document to its own row"
        if reason
        else "",
    )
    if is_moe(model_config):
        validate_experts(cfg, model_config)
    else:
        rate = cfg.moe.bias_update_rate
        need(not rate, f"moe.bias_update_rate={rate}: the model ({model_config.model_type}) has no experts")


def validate_context_parallel(cfg: TrainConfig, model_config) -> None:
    """context_parallel_size against the model: Ulysses splits each TP rank's heads over the C ranks."""
    cp = cfg.context_parallel_size
    if cp == 1:
        return
    heads = model_config.num_attention_heads // cfg.tensor_parallel_size
    per_tp = " per tensor-parallel rank" if cfg.tensor_parallel_size > 1 else ""
    need(
        heads % cp == 0,
        f"context_parallel_size={cp} must divide the model's {heads} attention heads{per_tp} (num_attention_heads="
        f"{model_config.num_attention_heads}): each CP rank attends with heads / C of them",
    )
    layers = range(model_config.num_hidden_layers)  # each layer's where they differ (Gemma 4's global layers)
    for whole in sorted({layer_attr(model_config, b, "num_key_value_heads") for b in layers}, reverse=True):
        kv = whole // cfg.tensor_parallel_size
        need(
            kv % cp == 0 or cp % kv == 0,
            f"context_parallel_size={cp} and the model's {kv} key/value heads{per_tp} (num_key_value_heads="
            f"{whole}): one must divide the other (fewer KV heads than C are replicated)",
        )


def validate_fp16(cfg: TrainConfig, model_config) -> None:
    """fp16 where transformers keeps trained weights in fp32 (`_keep_in_fp32_modules`: gpt-oss's norms): DeepSpeed's
    fp16 optimizer trains fp16 weights. Frozen ones stay fp32 (training/engine.py): DeepSeek-V3.2's indexer, and
    every base weight under LoRA."""
    if cfg.deepspeed.precision != "fp16" or cfg.lora.enabled:
        return
    family = family_of(model_config)
    frozen = tuple(f".{name}." for name in family.frozen)
    keys = [memory_key(model_config, k) for layer in all_layer_keys(model_config).values() for k in layer.values()]
    keys = [k for k in keys if not any(f in k for f in frozen)]
    names = sorted(n for n in family.fp32_in_fp16() if any(re.search(n, k) for k in keys))
    need(
        not names,
        f"deepspeed.precision=fp16: transformers keeps {model_config.model_type}'s {', '.join(names)} in fp32 under "
        "fp16 (_keep_in_fp32_modules), and DeepSpeed's fp16 optimizer trains fp16 weights; use bf16 or fp32 (or LoRA, "
        "which keeps them frozen in fp32)",
    )


def validate_expert_parallel(cfg: TrainConfig, world_size: int, model_config) -> None:
    """expert_parallel_size against the model and the layout."""
    ep = cfg.expert_parallel_size
    need(ep >= 1, f"expert_parallel_size={ep} must be >= 1")
    if ep == 1:
        return
    need(is_moe(model_config), f"expert_parallel_size={ep}: the model ({model_config.model_type}) has no experts")
    # The experts split over consecutive ranks of a stage's data axis: its DP replicas and, inside each, its CP ranks
    # (training/topology.py), which route their own positions' tokens alike.
    cp = cfg.context_parallel_size
    dp = world_size // (cfg.num_stages * cfg.tensor_parallel_size * cp)
    ranks = f"data-parallel size {dp}" if cp == 1 else f"{dp * cp} data ranks (DP={dp} x CP={cp})"
    need((dp * cp) % ep == 0, f"expert_parallel_size={ep} does not divide the {ranks} of each stage")
    experts = num_experts(model_config)
    need(experts % ep == 0, f"expert_parallel_size={ep} does not divide the model's {experts} experts")
    precision = cfg.deepspeed.precision
    need(
        precision != "fp16",
        f"expert_parallel_size={ep} runs with fp32 or bf16, not fp16: DeepSpeed's fp16 optimizer with experts is "
        "not proven here (no fp16 on CPU ranks)",
    )
    need(
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
    need(
        jitter == 0.0,
        f"router_jitter_noise={jitter} in the model's config.json: random multiplicative noise on the router's "
        "input cannot be reproduced exactly (set it to 0.0)",
    )
    if cfg.lora.enabled:
        check_target_modules(cfg.lora.target_modules, model_config)
    need(
        cfg.moe.aux_loss_coef is None or cfg.moe.aux_loss_coef >= 0,
        f"moe.aux_loss_coef={cfg.moe.aux_loss_coef} must be >= 0",
    )
    rate = cfg.moe.bias_update_rate
    need(rate >= 0, f"moe.bias_update_rate={rate} must be >= 0")
    need(
        not (rate and cfg.lora.enabled),
        f"moe.bias_update_rate={rate} with lora.enabled=true: --merge-lora exports the base model's score biases, "
        "not the balanced ones; balance without LoRA",
    )
    need(
        not rate or family_of(model_config).moe.score_bias,
        f"moe.bias_update_rate={rate}: {model_config.model_type}'s router has no score bias to balance with "
        f"(a router that chooses by scores plus e_score_correction_bias: {', '.join(balanced_families())}); leave it 0",
    )
    if family_of(model_config).moe.aux_loss:
        return
    name = model_config.model_type
    need(
        not cfg.moe.aux_loss_coef,
        f"moe.aux_loss_coef={cfg.moe.aux_loss_coef}: transformers trains {name} with no load-balancing loss (its "
        "sigmoid router has none to reproduce); leave it 0",
    )
    if not getattr(model_config, "attn_temperature_tuning", False):  # Llama 4's NoPE layers
        return
    need(
        not (cfg.data.documents_share_rows and cfg.seq_length > model_config.floor_scale),
        f"data.packing/concatenate with seq_length={cfg.seq_length} > floor_scale={model_config.floor_scale}: "
        f"{name}'s attention temperature counts positions from the row's start, not each document's (transformers "
        "ignores position_ids there); use rows of at most floor_scale tokens or unpacked rows",
    )


def validate_bf16_gradients(ds: DeepSpeedConfig) -> None:
    """The gradient dtypes DeepSpeed (0.19.8, `DeepSpeedEngine._do_optimizer_sanity_check`, a NotImplementedError
    traceback otherwise) takes for the weights' precision: bf16 weights with fp32 gradients only on its ZeRO-1 path,
    fp32 weights with fp32 gradients only. `ds`: resolved."""
    need(
        ds.precision != "bf16" or ds.zero_stage >= 1 or ds.grad_accum_dtype == "bf16",
        f"deepspeed.zero_stage=0 with bf16 needs deepspeed.grad_accum_dtype=bf16, not {ds.grad_accum_dtype or 'fp32'}: "
        "DeepSpeed keeps fp32 gradients for bf16 weights only with ZeRO-1 (deepspeed=bf16_zero1)",
    )
    need(
        ds.precision != "fp32" or ds.grad_accum_dtype in (None, "fp32"),
        f"deepspeed.precision=fp32 with deepspeed.grad_accum_dtype={ds.grad_accum_dtype}: fp32 weights accumulate "
        "fp32 gradients (DeepSpeed refuses the mix); set deepspeed.grad_accum_dtype=fp32 or leave it unset",
    )


def validate_optimizer(cfg: TrainConfig, ds: DeepSpeedConfig) -> None:
    """`optim.name=muon` where its matrices are whole (`ds`: resolved): fp32 with ZeRO-0 (our optimizer holds the
    parameters), or bf16 with ZeRO-1 and fp32 gradients (DeepSpeed's bf16 optimizer: every rank holds the group's
    reduced gradients, training/muon.py `_partition_step`)."""
    fp32 = (ds.precision, ds.zero_stage) == ("fp32", 0)
    bf16 = (ds.precision, ds.zero_stage) == ("bf16", 1) and ds.grad_accum_dtype in (None, "fp32")
    need(
        cfg.optim.name != "muon" or ((fp32 or bf16) and not ds.offload_optimizer),
        f"optim.name=muon runs with deepspeed=fp32 (fp32, ZeRO-0) or deepspeed=bf16_zero1 (bf16, ZeRO-1, fp32 "
        f"gradients), not {ds.precision} with ZeRO-{ds.zero_stage}"
        f"{', bf16 gradients' if ds.grad_accum_dtype == 'bf16' else ''}"
        f"{', the optimizer offloaded' if ds.offload_optimizer else ''}: DeepSpeed's other optimizers step flat "
        "partitions without the whole matrices Muon orthogonalises (and DeepSpeed's own Muon refuses the pipeline "
        "engine)",
    )


def validate_offload(ds: DeepSpeedConfig) -> None:
    """Optimizer offload under the pipeline engine, with the precision and ZeRO stage this machine resolves (`ds`)."""
    if not ds.offload_optimizer:
        return
    need(
        ds.precision != "bf16",
        "deepspeed.offload_optimizer=true with bf16 is not supported by DeepSpeed's pipeline engine "
        "(DeepSpeed issue 3866); use deepspeed=fp16_offload",
    )
    need(ds.zero_stage >= 1, "deepspeed.offload_optimizer=true needs deepspeed.zero_stage=1")
