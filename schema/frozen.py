"""A run's config, read-only once resolved: `freeze(cfg)` (training/assembly.py calls it once the precision, the ZeRO
stage and the Hub ids are resolved, before anything is built from it), so `cfg.deepspeed.precision` means one thing
for every reader. Assigning to a frozen config, or to any config inside it, raises `FrozenConfigError` naming the
field; `dataclasses.replace` still derives a new, unfrozen one.

Each config class gets a subclass of its own (`FrozenTrainConfig`, ...) whose `__setattr__` refuses; it is one of
this module's names, so frozen configs pickle and copy as they did.
"""

from __future__ import annotations

import dataclasses
import sys

FROZEN = "_frozen"


class FrozenConfigError(AttributeError):
    """An assignment to a config frozen once resolved."""


def _refuse(self, name: str) -> None:
    if self.__dict__.get(FROZEN, False):
        base = type(self).__mro__[1].__name__
        raise FrozenConfigError(
            f"{base}.{name}: the run's config is frozen once resolved (training/assembly.py); derive another with "
            "dataclasses.replace"
        )


def _set(self, name: str, value) -> None:
    _refuse(self, name)
    object.__setattr__(self, name, value)


def _delete(self, name: str) -> None:
    _refuse(self, name)
    object.__delattr__(self, name)


_CLASSES: dict[type, type] = {}


def _frozen_class(cls: type) -> type:
    if cls not in _CLASSES:
        name = f"Frozen{cls.__name__}"
        frozen = type(name, (cls,), {"__setattr__": _set, "__delattr__": _delete, "__module__": __name__})
        frozen.__qualname__ = name
        setattr(sys.modules[__name__], name, frozen)  # found by pickle
        _CLASSES[cls] = frozen
    return _CLASSES[cls]


def is_frozen(cfg) -> bool:
    return bool(getattr(cfg, "__dict__", {}).get(FROZEN, False))


def freeze(cfg):
    """`cfg` and every config dataclass inside it (its fields, their lists and dicts) read-only; returns `cfg`."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        for f in dataclasses.fields(cfg):
            freeze(getattr(cfg, f.name))
        if not is_frozen(cfg):
            cfg.__class__ = _frozen_class(type(cfg))
            object.__setattr__(cfg, FROZEN, True)
    elif isinstance(cfg, (list, tuple)):
        for item in cfg:
            freeze(item)
    elif isinstance(cfg, dict):
        for item in cfg.values():
            freeze(item)
    return cfg
