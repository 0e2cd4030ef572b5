"""The family's transformers classes with a mixin of ours in front (`on_family_class`: the pipeline layers of
models/layers.py), and its rotary embedding with fp32 tables. Model code: below models/layers.py, above the registry."""

from __future__ import annotations

import functools

from torch import nn

from models.cast import apply_keeping_fp32
from models.families import FAMILIES, family_of


class _Fp32Rotary:
    """Mixin for HF's rotary embedding: its tables (`inv_freq`, `original_inv_freq`, one per layer type where the
    family keeps them so) stay fp32 when the module is cast: a bf16 `inv_freq` shifts RoPE angles by whole radians at
    long positions."""

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp32(
            self, lambda name, _: name.endswith("inv_freq"), fn, lambda: super(_Fp32Rotary, self)._apply(fn, recurse)
        )


def on_family_class(mixin: type, model_type: str, hf_suffix: str, name: str) -> type[nn.Module]:
    """A class `<Prefix><name>` that puts `mixin` in front of the family's transformers `<Prefix><hf_suffix>`."""
    family = FAMILIES[model_type]
    attrs = {"__module__": mixin.__module__, "model_type": model_type}
    return type(family.prefix + name, (mixin, family.hf_class(hf_suffix)), attrs)


def has_rope(config) -> bool:
    """Whether the family's transformers module has a rotary embedding (Nemotron-H's attention has none)."""
    family = family_of(config)
    return hasattr(family.module(), family.prefix + family.class_names.get("RotaryEmbedding", "RotaryEmbedding"))


@functools.cache
def rotary_class(model_type: str) -> type[nn.Module]:
    """The family's own rotary embedding (`LlamaRotaryEmbedding`, ...) with an fp32 `inv_freq`."""
    return on_family_class(_Fp32Rotary, model_type, "RotaryEmbedding", "Fp32RotaryEmbedding")
