"""The dense decoder families this project trains, and where transformers keeps each one's classes.

A family is a `model_type` of `config.json`. Each reuses transformers' own decoder layer, RMSNorm and
rotary embedding for that family (models/layers.py builds the pipeline classes on them), so the maths is
HF's own. What differs between families, as data:

    family    q/k/v/o biases                    MLP biases     q/k norms    sliding window
    llama     config.attention_bias (all four)  config.mlp_bias  -          -
    mistral   -                                 -              -            config.sliding_window (every layer)
    qwen2     q, k, v always                    -              -            layer_types == "sliding_attention"
    qwen3     config.attention_bias (all four)  -              per head     layer_types == "sliding_attention"

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers class prefix: Llama, Mistral, Qwen2, Qwen3
    attention_bias: str  # "config" (config.attention_bias), "qkv" (q/k/v always) or "none"
    mlp_bias: bool  # config.mlp_bias applies
    qk_norm: bool  # RMSNorm over head_dim on q and k (self_attn.q_norm / k_norm)

    def module(self):
        return importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")

    def hf_class(self, suffix: str):
        """transformers' `<Prefix><suffix>` of this family, e.g. DecoderLayer, RMSNorm, RotaryEmbedding."""
        return getattr(self.module(), self.prefix + suffix)

    @property
    def config_class(self) -> str:
        return self.prefix + "Config"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", attention_bias="config", mlp_bias=True, qk_norm=False),
        Family("mistral", "Mistral", attention_bias="none", mlp_bias=False, qk_norm=False),
        Family("qwen2", "Qwen2", attention_bias="qkv", mlp_bias=False, qk_norm=False),
        Family("qwen3", "Qwen3", attention_bias="config", mlp_bias=False, qk_norm=True),
    )
}


def hf_classes(suffix: str) -> tuple[type, ...]:
    """transformers' `<Prefix><suffix>` class of every family (for isinstance checks)."""
    return tuple(family.hf_class(suffix) for family in FAMILIES.values())


def family_of(config) -> Family:
    """The family of a transformers config (KeyError for a model type not in FAMILIES)."""
    return FAMILIES[getattr(config, "model_type", None) or "llama"]


def sliding_window(config, attention) -> int | None:
    """The window of one layer's attention module (None: full causal attention), as HF applies it."""
    if family_of(config).model_type == "mistral":
        return getattr(config, "sliding_window", None)
    return getattr(attention, "sliding_window", None)
