"""What `deepspeed.precision=auto` and an unset `deepspeed.zero_stage` mean: one rule for the trainer, its config
checks and tools/memory_estimate.py.

The run's config is resolved once (`resolve`, in training/assembly.py, right after its checks) and frozen once its Hub
ids are resolved too (schema/frozen.py): from then on the engine config, the saved layout, the DPO reference cache and
the layout checks read `cfg.deepspeed.precision` and `.zero_stage` as they are, and nothing can assign them. Before
that only `validate` (what this machine will make of the config) and the memory planner (what a bf16 GPU will)
resolve them, each through `resolved`.
"""

from __future__ import annotations

import dataclasses

import torch


def device_precision() -> str:
    """What `precision=auto` means on this machine: bf16 on a bf16-capable GPU, fp16 (dynamic loss
    scaling) on other GPUs (V100, T4), fp32 on CPU."""
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


def resolve_precision(precision: str, auto: str | None = None) -> str:
    """`precision` with "auto" resolved: to `auto` when given (the memory planner plans for a bf16 GPU),
    else to `device_precision()`. The one rule for the trainer and tools/memory_estimate.py."""
    if precision != "auto":
        return str(precision)
    return auto or device_precision()


def resolved(ds, auto: str | None = None, gpu: bool | None = None):
    """`ds` (a `DeepSpeedConfig`) with `precision=auto` and an unset `zero_stage` replaced by what they mean on this
    machine, or on the one `auto` (its precision) and `gpu` describe."""
    precision = type(ds.precision)(resolve_precision(ds.precision, auto))
    return dataclasses.replace(ds, precision=precision, zero_stage=resolve_zero_stage(ds.zero_stage, gpu))


def resolve(cfg) -> None:
    """Resolve the run's `cfg.deepspeed` in place, once (see the module docstring)."""
    cfg.deepspeed = resolved(cfg.deepspeed)


def is_resolved(ds) -> bool:
    return ds.precision != "auto" and ds.zero_stage is not None


def resolve_zero_stage(zero_stage: int | None, gpu: bool | None = None) -> int:
    """`zero_stage` with None resolved: ZeRO-1 on GPUs (`gpu`, default: this machine has one), 0 on CPU."""
    if zero_stage is not None:
        return zero_stage
    return 1 if (torch.cuda.is_available() if gpu is None else gpu) else 0
