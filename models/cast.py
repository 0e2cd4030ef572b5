"""What stays fp32 when a layer is cast to fp16 or bf16 (`nn.Module._apply`): RoPE's tables, and what transformers
keeps fp32 in that dtype (models/families `Family.keeps_fp32`)."""

from __future__ import annotations

import torch
from torch import nn


def apply_keeping_fp32(module: nn.Module, keep, fn, apply) -> nn.Module:
    """`apply()` (`module._apply(fn)`: a cast or a move) with the buffers and parameters that `keep(name, dtype)`
    selects for the dtype `fn` casts to left fp32, on the device `fn` moves them to."""
    dtype = fn(torch.zeros(())).dtype  # what the cast makes of an fp32 tensor (a move leaves it fp32: nothing kept)
    if dtype not in (torch.float16, torch.bfloat16):
        return apply()
    tensors = [(n, t) for n, t in [*module.named_buffers(), *module.named_parameters()] if t.is_floating_point()]
    kept = {n: t.data.float() for n, t in tensors if keep(n, dtype)}  # (.data: apply() replaces it)
    apply()
    for name, data in kept.items():
        owner, _, leaf = name.rpartition(".")
        holder = module.get_submodule(owner)
        if leaf in holder._buffers:
            holder._buffers[leaf] = data.to(holder._buffers[leaf].device)
        else:
            holder._parameters[leaf].data = data.to(holder._parameters[leaf].device)
    return module
