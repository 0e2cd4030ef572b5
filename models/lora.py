"""LoRA adapters on the decoder layers (through `peft`), and merging them back: W + (alpha / r) * B @ A.

Adapters are injected into each `DecoderLayerPipe` after its base weights are loaded; every other
parameter is frozen. Keys inside a layer follow peft: the base `self_attn.q_proj.weight` becomes
`self_attn.q_proj.base_layer.weight`, with `self_attn.q_proj.lora_A.default.weight` [r, in] and
`self_attn.q_proj.lora_B.default.weight` [out, r] beside it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

ADAPTER = "default"
LORA_A, LORA_B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"


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


def merge_adapter(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float) -> dict:
    """Merge one layer's adapter into its base weights (keys as in the base layer file).

    Args:
        base: {"self_attn.q_proj.weight": W [out, in], ...} (plain keys, no `base_layer`).
        adapter: {"self_attn.q_proj.lora_A.default.weight": A [r, in], "...lora_B...": B [out, r]}.
        scale: alpha / r.
    """
    merged = dict(base)
    for key, a in adapter.items():
        if not key.endswith(LORA_A):
            continue
        prefix = key.removesuffix(LORA_A)
        b = adapter[prefix + LORA_B]
        w = base[prefix + ".weight"]
        merged[prefix + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return merged
