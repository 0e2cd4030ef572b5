"""Streaming reader for Hugging Face checkpoints: one shard open at a time, one tensor at a time.

Supports `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin` and sharded `pytorch_model-*.bin` with `pytorch_model.bin.index.json`.
Every shard is validated (present, complete) before the first tensor is read, so a bad
checkpoint fails before anything is written.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator

import torch
from safetensors import safe_open


class CheckpointError(Exception):
    """A checkpoint is missing, truncated or does not match what is expected. One-line message."""


SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


def _shards_from_index(hf_dir: str, index_name: str) -> tuple[list[str], dict[str, str]]:
    path = os.path.join(hf_dir, index_name)
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise CheckpointError(f"{path}: not a valid index file ({e})") from None
    shards = list(dict.fromkeys(weight_map.values()))  # file order of first appearance
    return shards, weight_map


def list_shards(hf_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """Shard file names in read order, and the index's key -> shard map (None without an index)."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"{hf_dir}: no such directory")
    for index_name in (SAFE_INDEX, BIN_INDEX):
        if os.path.exists(os.path.join(hf_dir, index_name)):
            return _shards_from_index(hf_dir, index_name)
    for single in (SAFE_SINGLE, BIN_SINGLE):
        if os.path.exists(os.path.join(hf_dir, single)):
            return [single], None
    raise CheckpointError(
        f"{hf_dir}: no weights found (expected {SAFE_INDEX}, {SAFE_SINGLE}, {BIN_INDEX} or {BIN_SINGLE})"
    )


def check_safetensors(path: str) -> list[str]:
    """Validate a safetensors file's header against its size; return its tensor names."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header says {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
    names = [k for k in header if k != "__metadata__"]
    end = max((header[k]["data_offsets"][1] for k in names), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, needs {8 + header_len + end})")
    return names


def validate(hf_dir: str) -> dict[str, str]:
    """Check that every shard is present and complete. Returns {tensor name: shard file}."""
    shards, weight_map = list_shards(hf_dir)
    found: dict[str, str] = {}
    for shard in shards:
        path = os.path.join(hf_dir, shard)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: shard listed in the index is missing")
        if shard.endswith(".safetensors"):
            for name in check_safetensors(path):
                found[name] = shard
        elif weight_map is None:
            found.update({k: shard for k in _load_bin(path)})
    if weight_map is not None:
        if not shards[0].endswith(".safetensors"):
            return dict(weight_map)
        missing = [k for k, shard in weight_map.items() if found.get(k) != shard]
        if missing:
            shard = os.path.join(hf_dir, weight_map[missing[0]])
            raise CheckpointError(f"{shard}: tensor {missing[0]} listed in the index is not in the shard")
    return found


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    try:
        # mmap: tensors are paged in when touched, so a shard costs little resident memory.
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # torch raises several types for damaged pickles/zips
        raise CheckpointError(f"{path}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from None


def iter_tensors(hf_dir: str) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (name, tensor, shard file) in shard order; only one shard is open at a time."""
    shards, _ = list_shards(hf_dir)
    for shard in shards:
        path = os.path.join(hf_dir, shard)
        if shard.endswith(".safetensors"):
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name), shard
        else:
            state = _load_bin(path)
            for name in list(state):
                yield name, state.pop(name), shard
            del state
