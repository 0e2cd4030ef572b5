"""Layer files in either format: DeepSpeed's `.pt` (torch.save) or `.safetensors`.

The trainer always saves `.pt` (DeepSpeed writes them); the converter can write either
(`--format`), and every reader here accepts both, so a safetensors conversion trains, exports,
inspects and verifies like a `.pt` one. `.pt` files are read with `checkpoint.safe_load`: a layer
file that holds anything but tensors is refused, never unpickled.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file, save_file

from checkpoint.errors import CheckpointError
from checkpoint.safe_load import load_pt
from models.layout import LAYER_FILE_FORMATS, layer_file_name, parse_layer_file_name

FORMATS = LAYER_FILE_FORMATS


def layer_path(step_dir: str, index: int, fmt: str = "pt", tp_rank: int = 0) -> str:
    return os.path.join(step_dir, layer_file_name(index, tp_rank, fmt))


def find_layer_file(step_dir: str, index: int, tp_rank: int = 0) -> str | None:
    """The layer's file in whichever format exists (`.pt` first), or None."""
    for fmt in FORMATS:
        path = layer_path(step_dir, index, fmt, tp_rank)
        if os.path.exists(path):
            return path
    return None


def is_layer_file(name: str) -> bool:
    return parse_layer_file_name(name) is not None


def load_layer_state(path: str, mmap: bool = False) -> dict[str, torch.Tensor]:
    """A layer file's {key: tensor}. `mmap` reads no tensor data until it is touched (`.pt` only).

    Raises:
        CheckpointError: unreadable, unsafe (a pickle naming code), or not a mapping of names to tensors.
    """
    if path.endswith(".safetensors"):
        try:
            state = load_file(path)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read layer file ({type(e).__name__}: {str(e)[:200]})") from None
    else:
        state = load_pt(path, mmap=mmap, what="layer file")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):  # fmt: skip
        raise CheckpointError(f"{path}: not a layer file (expected names -> tensors)")
    return state


def layer_tensor_specs(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of a layer file without reading tensor data (header / memory map)."""
    if path.endswith(".safetensors"):
        from checkpoint.dtypes import SAFETENSORS_DTYPES
        from checkpoint.hf_reader import read_safetensors_header

        header = read_safetensors_header(path)[1]
        return {k: (tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for k, e in header.items()}
    return {k: (tuple(v.shape), v.dtype) for k, v in load_layer_state(path, mmap=True).items()}


def save_layer_state(state: dict[str, torch.Tensor], path: str) -> None:
    if path.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(state, path)
