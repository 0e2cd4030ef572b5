"""What `deepspeed.precision=auto` and an unset `deepspeed.zero_stage` mean: one rule for the trainer, its config
checks and tools/memory_estimate.py."""

from __future__ import annotations

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


def resolve_zero_stage(zero_stage: int | None, gpu: bool | None = None) -> int:
    """`zero_stage` with None resolved: ZeRO-1 on GPUs (`gpu`, default: this machine has one), 0 on CPU."""
    if zero_stage is not None:
        return zero_stage
    return 1 if (torch.cuda.is_available() if gpu is None else gpu) else 0
