"""Reading a transformers config: one whose layers differ in shape (`per_layer_config`: Gemma 4's global layers
keep their own `head_dim` and `num_key_value_heads`, and transformers refuses to read those globally), and its
`dtype` as transformers' layers read it."""

from __future__ import annotations


def global_attr(config, name: str, default=None):
    """A config attribute as config.json states it, also where transformers' config keeps it per layer and refuses to
    read it globally (Gemma 4's `head_dim` and `num_key_value_heads`: `per_layer_config`; `layer_attr` has each
    layer's)."""
    read = getattr(config, "_getattr_without_heterogeneous_validation", None)
    return read(name, default) if read is not None else getattr(config, name, default)


def layer_attr(config, block: int, name: str, default=None):
    """A config attribute of decoder block `block`: its `per_layer_config` entry where the config has one."""
    if getattr(config, "is_heterogeneous", False):
        return getattr(config.per_layer_config[block], name, default)
    return getattr(config, name, default)


def with_torch_dtype(config):
    """`config` with `dtype` a torch.dtype, as transformers' `from_pretrained` makes it before building a model: a
    config read from config.json (or written by `save_pretrained`) holds its name, and some layers build parameters
    in it (Apertus's xIELU). Returns `config`, changed in place."""
    if isinstance(getattr(config, "dtype", None), str):
        import torch

        config.dtype = getattr(torch, config.dtype)
    return config


def norm_eps(config) -> float:
    """The norms' epsilon, under the name the family's config class declares (each declares one): `rms_norm_eps`,
    `layer_norm_epsilon` (Nemotron-H's, whose hub config.json also holds an unread `norm_eps`), `layer_norm_eps`
    (Cohere's), `norm_eps` (LFM2's); a field a config.json carries beside it is not read."""
    declared = getattr(type(config), "__dataclass_fields__", {})
    for name in ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_eps"):
        if name in declared and getattr(config, name, None) is not None:
            return getattr(config, name)
    eps = getattr(config, "norm_eps", None)
    return config.rms_norm_eps if eps is None else eps
