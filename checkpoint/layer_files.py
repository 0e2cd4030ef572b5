"""Layer files in either format: DeepSpeed's `.pt` (torch.save) or `.safetensors`.

The trainer always saves `.pt` (DeepSpeed writes them); the converter can write either
(`--format`), and every reader here accepts both, so a safetensors conversion trains, exports,
inspects and verifies like a `.pt` one.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from models.layout import layer_file_name

FORMATS = ("pt", "safetensors")


def layer_path(step_dir: str, index: int, fmt: str = "pt", tp_rank: int = 0) -> str:
    name = layer_file_name(index, tp_rank)
    if fmt == "safetensors":
        name = name.removesuffix(".pt") + ".safetensors"
    return os.path.join(step_dir, name)


def find_layer_file(step_dir: str, index: int, tp_rank: int = 0) -> str | None:
    """The layer's file in whichever format exists (`.pt` first), or None."""
    for fmt in FORMATS:
        path = layer_path(step_dir, index, fmt, tp_rank)
        if os.path.exists(path):
            return path
    return None


def is_layer_file(name: str) -> bool:
    return name.startswith("layer_") and name.endswith(("-model_states.pt", "-model_states.safetensors"))


def load_layer_state(path: str, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A layer file's {key: tensor}. `mmap` reads no tensor data until it is touched (`.pt` only)."""
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)


def layer_tensor_specs(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of a layer file without reading tensor data (header / memory map)."""
    if path.endswith(".safetensors"):
        from checkpoint.hf_reader import SAFETENSORS_DTYPES, read_safetensors_header

        header = read_safetensors_header(path)[1]
        return {k: (tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for k, e in header.items()}
    return {k: (tuple(v.shape), v.dtype) for k, v in load_layer_state(path, mmap=True).items()}


def save_layer_state(state: dict[str, torch.Tensor], path: str) -> None:
    if path.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)
