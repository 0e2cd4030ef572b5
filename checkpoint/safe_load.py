"""Loading `.pt` files that someone else may have made, without running their code.

A full unpickle (`torch.load` without `weights_only`) rebuilds arbitrary objects, and unpickling calls
whatever callable the file names: a downloaded checkpoint could run any code on `--inspect`. Every `.pt` file this
project reads itself goes through `load_pt`: `weights_only=True` (tensors, containers, numbers,
strings) plus the few plain-data globals in `safe_globals()`. A file that names anything else is
refused with one line naming the file and the global; nothing in it runs.

NOTE: DeepSpeed's own `load_checkpoint` (a `resume` in the same layout) fully unpickles the engine and optimizer
files of a run directory (its layer files are read through `load_pt`: `checkpoint.layer_files.
layer_files_as_plain_data`): resuming trusts that directory (docs/reliability_and_security.md).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import torch

from checkpoint.errors import CheckpointError


@functools.cache
def safe_globals() -> tuple:
    """The non-tensor types our own loads accept: numpy's array reconstruction (RNG states hold numpy's
    generator state, an array of ints). Plain data, nothing that runs."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    return (core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))


# DeepSpeed's own plain-data types inside its ZeRO optimizer shards, which only DeepSpeed loads (a resume):
# `check_pickles` accepts them by name (the file is scanned, not loaded; DeepSpeed is not imported).
DEEPSPEED_DATA_GLOBALS = (
    "deepspeed.utils.tensor_fragment.fragment_address",  # two ints
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",  # numbers
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",  # an int enum
)


def deepspeed_data_classes() -> list:
    """The classes `DEEPSPEED_DATA_GLOBALS` names (imports DeepSpeed), for a `torch.load` of its ZeRO shards."""
    import importlib

    return [getattr(importlib.import_module(m), n) for m, _, n in (g.rpartition(".") for g in DEEPSPEED_DATA_GLOBALS)]


def _allowed_names() -> set[str]:
    return {f"{g.__module__}.{g.__qualname__}" for g in safe_globals()} | set(DEEPSPEED_DATA_GLOBALS)


def _unsafe_globals(path: str, error: Exception) -> list[str]:
    try:
        with torch.serialization.safe_globals(safe_globals()):
            found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip: fall back to the message
        found = []
    found = [g for g in found if g not in _allowed_names()]
    return found or re.findall(r"GLOBAL ([\w.]+)", str(error))[:1]


def load_pt(path: str, mmap: bool = False, what: str = "file") -> Any:
    """`torch.load` of a file that may come from anyone: plain data only, else CheckpointError.

    Args:
        path: a `.pt`/`.bin` file written with `torch.save`.
        mmap: memory-map tensor data (zip files only): nothing is read until it is touched.
        what: how the error message names the file ("layer file", ...).
    """
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises several types for unsafe or damaged pickles
        unsafe = _unsafe_globals(path, e) if "GLOBAL" in str(e) or "global" in str(e) else []
        if unsafe:
            raise CheckpointError(
                f"{path}: refused: it names {unsafe[0]}, which is not tensor data (unpickling it could run code)"
            ) from None
        raise CheckpointError(f"{path}: cannot read {what} ({_reason(e)})") from None


def _reason(error: Exception) -> str:
    """The informative line of torch's message (its weights-only errors open with advice we never follow)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if line.startswith("WeightsUnpickler error:")]
    text = detail[0].removeprefix("WeightsUnpickler error:").strip() if detail else (lines or [""])[0]
    if not detail and text.startswith("Weights only load failed"):
        text = "not a PyTorch checkpoint, or damaged"
    return f"{type(error).__name__}: {text[:200]}"


def check_pickles(directory: str, names: list[str]) -> None:
    """Refuse `directory` if any of `names` (`.pt` files in it that this command does not otherwise need)
    names a global beyond plain data. The pickles are scanned, not loaded: nothing in them runs."""
    allowed = _allowed_names()
    for name in names:
        path = os.path.join(directory, name)
        try:
            unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in allowed]
        except Exception as e:  # noqa: BLE001 - not a zip, damaged pickle
            raise CheckpointError(f"{path}: cannot read ({_reason(e)})") from None
        if unsafe:
            raise CheckpointError(
                f"{path}: refused: it names {unsafe[0]}, which is not tensor data (unpickling it could run code)"
            )
