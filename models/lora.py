"""LoRA adapters on the decoder layers (through `peft`), and merging them back: W + (alpha / r) * B @ A.

Adapters are injected into each `DecoderLayerPipe` after its base weights are loaded; every other
parameter is frozen. Keys inside a layer follow peft: the base `self_attn.q_proj.weight` becomes
`self_attn.q_proj.base_layer.weight`, with `self_attn.q_proj.lora_A.default.weight` [r, in] and
`self_attn.q_proj.lora_B.default.weight` [out, r] beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from models.layout import linear_modules

ADAPTER = "default"
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


def check_target_modules(targets: list[str]) -> None:
    """Every `lora.target_modules` entry must name a linear layer of the decoder (PEFT matches a name or its
    last dotted parts; it only complains when nothing at all matches). Raises ValueError naming the entry."""
    modules = linear_modules()
    for target in targets:
        if not any(m == target or m.endswith("." + target) for m in modules):
            names = ", ".join(m.rsplit(".", 1)[-1] for m in modules)
            raise ValueError(f"lora.target_modules: {target!r} is not a linear layer of the decoder ({names})")


def add_lora(module: nn.Module, r: int, alpha: float, dropout: float, target_modules: list[str], seed: int) -> int:
    """Inject LoRA into every decoder layer of `module` and freeze everything else.

    Each layer's adapter is initialised from `seed + block number`, so data-parallel replicas of a
    stage start identical whatever rank builds them. Returns the number of trainable parameters.
    """
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    for p in module.parameters():
        p.requires_grad_(False)
    for layer in module.modules():
        if isinstance(layer, LlamaDecoderLayer):  # our DecoderLayerPipe, or HF's own (the test reference)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + layer.self_attn.layer_idx)
                inject_adapter_in_model(config, layer, adapter_name=ADAPTER)
    trainable = 0
    for name, p in module.named_parameters():
        p.requires_grad_(".lora_" in name)
        trainable += p.numel() if p.requires_grad else 0
    return trainable


@dataclass(frozen=True)
class LoraDelta:
    """One adapted module: W += scale * B @ A, with A [r, in], B [out, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def merge_adapter(base: dict[str, torch.Tensor], deltas: dict[str, LoraDelta]) -> dict[str, torch.Tensor]:
    """Merge one layer's adapters into its base weights (keys as in the base layer file).

    Args:
        base: {"self_attn.q_proj.weight": W [out, in], ...} (plain keys, no `base_layer`).
        deltas: {"self_attn.q_proj": LoraDelta, ...}.

    The arithmetic is PEFT's `merge_and_unload` for fp32 weights: W + (B @ A) * scale, in fp32.
    """
    merged = dict(base)
    for module, d in deltas.items():
        w = base[module + ".weight"]
        merged[module + ".weight"] = (w.float() + (d.b.float() @ d.a.float()) * d.scale).to(w.dtype)
    return merged
