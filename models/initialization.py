"""Weights for runs that start from scratch instead of a checkpoint: transformers' LLaMA initialisation, with each
family's norm weights at what its RMSNorm starts from."""

from __future__ import annotations

import torch
from torch import nn

from models.families import FAMILIES, hf_classes


@torch.no_grad()
def init_weights(module: nn.Module, initializer_range: float) -> None:
    """HF LLaMA initialisation, for runs that start from scratch instead of a checkpoint."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(0.0, initializer_range)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, initializer_range)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif (
            isinstance(m, hf_classes("RMSNorm")) and getattr(m, "weight", None) is not None
        ):  # (Gemma 4's v_norm: none)
            family = next(f for f in FAMILIES.values() if isinstance(m, f.hf_class("RMSNorm")))
            m.weight.fill_(family.initial_norm_weight())  # 1, or 0 for (1 + w) norms
        elif type(m).__name__.endswith(("Experts", "TopKRouter", "HashRouter")):  # fused experts, routers
            for p in m.parameters(recurse=False):
                p.normal_(0.0, initializer_range)
        elif type(m).__name__.endswith(("HyperConnection", "HyperHead")):  # DeepSeek-V4's, as transformers does
            biases, weights, scales = (p for _, p in sorted(m.named_parameters(recurse=False)))  # base, fn, scale
            weights.normal_(0.0, initializer_range)
            biases.zero_()
            scales.fill_(1.0)
        elif type(m).__name__.endswith(("Attention", "Compressor", "Indexer")):  # sinks, position biases: zeros
            for name, p in m.named_parameters(recurse=False):
                if name in ("sinks", "position_bias"):
                    p.zero_()
