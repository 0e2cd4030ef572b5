"""Streaming reader for Hugging Face checkpoints: one shard open at a time, one tensor at a time.

Supports `model.safetensors`, sharded safetensors with `model.safetensors.index.json`,
`pytorch_model.bin` and sharded `pytorch_model-*.bin` with `pytorch_model.bin.index.json`.
Every shard is validated (present, complete) before the first tensor is read, so a bad
checkpoint fails before anything is written.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Iterator

import torch

from checkpoint.dtypes import SAFETENSORS_DTYPES
from checkpoint.errors import CheckpointError
from checkpoint.names import LATEST
from checkpoint.read_ahead import ReadAhead, whole_files
from checkpoint.safe_load import load_pt

SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
# DeepSeek-V4's release name of an FP8 weight's scales, and transformers' (its FP8 loader renames the one to the other)
FP8_SCALE_ALIAS = (".scale", ".weight_scale_inv")
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"


def read_model_config(path: str):
    """The transformers config of an HF model directory or a pipeline checkpoint; errors name config.json."""
    from models.config import load_hf_config

    try:
        return load_hf_config(path)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def container_of(hf_dir: str):
    """The container a multimodal checkpoint is (models/families `CONTAINERS`: where its text model's keys sit), or
    a checkpoint in its family's own release layout (`ReleaseNames`), or None for a text model in transformers'
    layout. Every function here names tensors by the text model's keys as transformers saves them and skips the
    other towers' tensors (which checkpoint/carried.py keeps aside), unless asked for the hub's own names (`raw`)."""
    from models.families import CONTAINERS, FAMILIES

    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if model_type in CONTAINERS:
        return CONTAINERS[model_type]
    family = FAMILIES.get(model_type)
    if family is None or not family.hub_renames:
        return None
    return _release_names(hf_dir, *(os.stat(os.path.join(hf_dir, n)).st_mtime_ns for n in list_shards(hf_dir)[0][:1]))


class ReleaseNames:
    """A checkpoint whose tensors carry its family's own release names (DeepSeek-V4's `layers.0.attn.wq_a.weight`,
    `embed.weight`, `hc_head_fn`: no `model.` prefix; an FP8 weight's scales `<module>.scale`), read under the names
    transformers saves (models/hub_names.py `hub_key`; the scales as `weight_scale_inv`), as a container's text model
    is read under its own."""

    def __init__(self, config):
        quant = getattr(config, "quantization_config", None) or {}
        quant = quant if isinstance(quant, dict) else quant.to_dict()
        self.config, self.scales = config, FP8_SCALE_ALIAS if quant.get("quant_method") == "fp8" else None

    def text_key(self, hub_key: str) -> str:
        from models.hub_names import hub_key as saved_name
        from models.hub_names import memory_key

        if self.scales and hub_key.endswith(self.scales[0]):
            hub_key = hub_key.removesuffix(self.scales[0]) + self.scales[1]
        return saved_name(self.config, memory_key(self.config, hub_key))

    def hub_key(self, text_key: str) -> str:
        from models.hub_names import release_key

        key = release_key(self.config, text_key)
        if self.scales and key.endswith(self.scales[1]):
            key = key.removesuffix(self.scales[1]) + self.scales[0]
        return key


class SavedNames:
    """A checkpoint as transformers' `save_pretrained` writes it where that names a tensor otherwise than the family's
    hub checkpoints (Kimi Linear's dense MLP under the sparse block's `block_sparse_moe`), read under the hub's names
    (models/hub_names.py `hub_key`)."""

    def __init__(self, config):
        self.config = config

    def text_key(self, file_key: str) -> str:
        from models.hub_names import hub_key, memory_key

        return hub_key(self.config, memory_key(self.config, file_key))

    def hub_key(self, text_key: str) -> str:
        from models.hub_names import memory_key, saved_key

        return saved_key(self.config, memory_key(self.config, text_key))


@functools.lru_cache(maxsize=16)
def _release_names(hf_dir: str, _stamp: int) -> ReleaseNames | SavedNames | None:
    """`ReleaseNames` where no tensor of the checkpoint is under `model.` nor where transformers saves the model
    (Nemotron-H's `backbone.`): the release layout; `SavedNames` where a tensor is named as transformers' save names
    it and the hub does not; else None."""
    from models.hub_names import hub_key, memory_key

    shards, weight_map = list_shards(hf_dir)
    if weight_map is not None:
        keys = list(weight_map)
    elif shards[0].endswith(".safetensors"):
        keys = check_safetensors(os.path.join(hf_dir, shards[0]))
    else:
        keys = list(_load_bin(os.path.join(hf_dir, shards[0])))
    config = read_model_config(hf_dir)
    saved = hub_key(config, "model.layers.0").removesuffix("layers.0")  # `model.`, or the family's saved name for it
    if any(k.startswith(("model.", saved)) for k in keys):
        return SavedNames(config) if any(hub_key(config, memory_key(config, k)) != k for k in keys) else None
    return ReleaseNames(config)


def _text_keys(mapping: dict[str, str], container) -> dict[str, str]:
    """`mapping` {file key: value} as {text model key: value}, the other towers' keys left out."""
    if container is None:
        return mapping
    return {text: v for k, v in mapping.items() if (text := container.text_key(k)) is not None}


def is_hf_dir(path: str) -> bool:
    """An HF model directory (weights + config.json), not a pipeline checkpoint (which has `latest`)."""
    if not os.path.exists(os.path.join(path, "config.json")) or os.path.exists(os.path.join(path, LATEST)):
        return False
    try:
        list_shards(path)
    except CheckpointError:
        return False
    return True


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


def read_safetensors_header(path: str) -> tuple[int, dict]:
    """(offset of the data section, header without __metadata__), validated against the file size."""
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
    header.pop("__metadata__", None)
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + header_len + end > size:
        raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, needs {8 + header_len + end})")
    return 8 + header_len, header


def check_safetensors(path: str) -> list[str]:
    """Validate a safetensors file's header against its size; return its tensor names."""
    return list(read_safetensors_header(path)[1])


def _planned_reads(path: str, names: set[str] | None) -> tuple[int, list[tuple[str, dict]]]:
    """(data start, [(name, header entry)] in file order) of the tensors of a shard `iter_safetensors` reads."""
    data_start, header = read_safetensors_header(path)
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    return data_start, [(name, entry) for name, entry in entries if names is None or name in names]


def iter_safetensors(
    path: str,
    names: set[str] | None = None,
    alloc: Callable[[int], torch.Tensor] | None = None,
    planned: tuple[int, list[tuple[str, dict]]] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield a shard's tensors in file order with plain reads into buffers of their own.

    `alloc(nbytes)` gives each tensor's uint8 buffer (default: a fresh one; conversion passes a
    `BufferPool` that recycles the buffers of layers already written). `planned`: `_planned_reads(path, names)`,
    when the caller read the header already.

    NOTE: not `safe_open`: it memory-maps the whole shard, and every page touched stays in the
    process's resident set until the shard is closed (1.6 GB of a 3.5 GB model in our benchmark).
    Plain reads keep resident memory to the tensors actually held.
    """
    data_start, reads = planned or _planned_reads(path, names)
    with open(path, "rb", buffering=0) as f:
        for name, entry in reads:
            begin, end = entry["data_offsets"]
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {entry['dtype']}")
            buf = alloc(end - begin) if alloc else torch.empty(end - begin, dtype=torch.uint8)
            f.seek(data_start + begin)
            view, done = memoryview(buf.numpy()), 0
            while done < len(view):
                n = f.readinto(view[done:])
                if not n:
                    raise CheckpointError(f"{path}: truncated while reading {name}")
                done += n
            yield name, buf.view(dtype).reshape(entry["shape"])


def validate(hf_dir: str, raw: bool = False) -> dict[str, str]:
    """Check that every shard is present and complete. Returns {tensor name: shard file} (the hub's own names with
    `raw`, else the text model's: `container_of`)."""
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
            return _text_keys(dict(weight_map), None if raw else container_of(hf_dir))
        missing = [k for k, shard in weight_map.items() if found.get(k) != shard]
        if missing:
            shard = os.path.join(hf_dir, weight_map[missing[0]])
            raise CheckpointError(f"{shard}: tensor {missing[0]} listed in the index is not in the shard")
    return _text_keys(found, None if raw else container_of(hf_dir))


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    # mmap: tensors are paged in when touched, so a shard costs little resident memory.
    state = load_pt(path, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: not a PyTorch state dict (expected names -> tensors)")
    return state


def iter_tensors(
    hf_dir: str, names: set[str] | None = None, alloc: Callable[[int], torch.Tensor] | None = None, raw: bool = False
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yield (name, tensor, shard file) in shard order; only one shard is open at a time.

    Args:
        hf_dir: the HF model directory.
        names: read only these tensors (and skip shards that hold none of them); None reads all.
        alloc: where safetensors data is read into (see `iter_safetensors`).
        raw: names are the hub's own, every tower's (else the text model's: `container_of`).
    """
    shards, weight_map = list_shards(hf_dir)
    container = None if raw else container_of(hf_dir)

    def text(name: str) -> str | None:  # the text model's name of a file key (a container's other towers: None)
        return name if container is None else container.text_key(name)

    if names is not None and container is not None:
        names = {container.hub_key(n) for n in names}
    shards = [s for s in shards if names is None or weight_map is None or any(weight_map.get(n) == s for n in names)]
    ranges, first, plans = [], [], {}  # what is read, in order (ReadAhead's); each shard's first range; headers
    for shard in shards:
        path = os.path.join(hf_dir, shard)
        first.append(len(ranges))
        if path.endswith(".safetensors"):
            start, reads = plans[path] = _planned_reads(path, names)
            ranges += [(path, start + e["data_offsets"][0], start + e["data_offsets"][1]) for _, e in reads]
        else:
            ranges += whole_files([path])
    with ReadAhead(ranges) as ahead:  # the disk reads on while the caller writes what it was given
        for shard, index in zip(shards, first):
            path = os.path.join(hf_dir, shard)
            if path.endswith(".safetensors"):
                for name, tensor in iter_safetensors(path, names, alloc, plans.pop(path)):
                    index += 1
                    ahead.reached(index)
                    if text(name) is not None:
                        yield text(name), tensor, shard
            else:
                state = _load_bin(path)
                for name in list(state):
                    tensor = state.pop(name)
                    if (names is None or name in names) and text(name) is not None:
                        yield text(name), tensor, shard
                del state
                ahead.reached(index + 1)


def stored_dtype(hf_dir: str) -> torch.dtype | None:
    """dtype of the first floating tensor, from a header or a memory-mapped load (no tensor data read)."""
    shards, _ = list_shards(hf_dir)
    for shard in shards:
        path = os.path.join(hf_dir, shard)
        if shard.endswith(".safetensors"):
            dtypes = [SAFETENSORS_DTYPES.get(e["dtype"]) for e in read_safetensors_header(path)[1].values()]
        else:
            dtypes = [t.dtype for t in _load_bin(path).values()]
        for dtype in dtypes:
            if dtype is not None and dtype.is_floating_point:
                return dtype
    return None
