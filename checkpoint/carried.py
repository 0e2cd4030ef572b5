"""Hub tensors a model carries without training them: kept aside at conversion, written back at export.

DeepSeek-V3's and GLM-4.5's checkpoints keep multi-token-prediction layers after the last decoder layer
(`model.layers.{L}..{L + n - 1}.*`, n = `num_nextn_predict_layers`), Qwen3-Next's under `mtp.*` (models/key_table.py
`is_carried`), which transformers' models do not run (they skip them at load) and this trainer does not train.
Dropping them would make an export something other than the model that came in, so a pipeline checkpoint holds them
as the hub stored them (names, dtypes, bytes; quantized ones with their scales) in one file at its root,
`hub_extra.safetensors`, written tensor by tensor (memory: one tensor). Every way a checkpoint is made passes it on:
conversion writes it, resharding, `--combine` and conversion at load copy it (`carry`), the trainer copies it into
its output_dir beside config.json, and export appends its tensors to the shards (`carried_plan`, `iter_carried`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from checkpoint.dtypes import SAFETENSORS_DTYPES
from checkpoint.hf_reader import (
    container_of,
    is_hf_dir,
    iter_safetensors,
    iter_tensors,
    list_shards,
    read_model_config,
    read_safetensors_header,
)
from checkpoint.names import CARRIED_FILE
from checkpoint.outputs import copy_from_input
from checkpoint.safetensors_writer import StreamingSafetensorsWriter
from models.key_table import is_carried


def _hub_specs(hf_dir: str, config) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(hub key, shape, dtype) of the carried tensors of an HF directory, from its safetensors headers, in the order
    `iter_tensors` reads them (shard by shard, by offset): the text model's untrained tensors, and a multimodal
    container's other towers (`container_of`: its vision tower, Qwen3.5's `mtp.*`)."""
    shards, _ = list_shards(hf_dir)
    container = container_of(hf_dir)

    def carried(key: str) -> bool:
        text = key if container is None else container.text_key(key)
        return text is None or is_carried(text, config)

    specs = []
    for shard in shards:
        if not shard.endswith(".safetensors"):
            continue
        _, header = read_safetensors_header(os.path.join(hf_dir, shard))
        for key, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            if carried(key):
                specs.append((key, tuple(entry["shape"]), SAFETENSORS_DTYPES[entry["dtype"]]))
    return specs


def carry(source: str, root: str, config=None) -> int:
    """Give the checkpoint at `root` the carried tensors of `source` (an HF directory: read from its shards; a
    pipeline checkpoint or piece: its file copied). Returns how many tensors; 0 writes nothing."""
    if not is_hf_dir(source):
        src = os.path.join(source, CARRIED_FILE)
        if not os.path.exists(src):
            return 0
        copy_from_input(src, os.path.join(root, CARRIED_FILE), source)
        return len(read_safetensors_header(src)[1])
    config = config or read_model_config(source)
    plan = _hub_specs(source, config)  # from the shards' headers: no tensor data read
    if plan:
        with StreamingSafetensorsWriter(os.path.join(root, CARRIED_FILE), plan, metadata={"format": "pt"}) as out:
            for name, tensor, _ in iter_tensors(source, {key for key, _, _ in plan}, raw=True):
                out.write(name, tensor)
    return len(plan)


def carried_plan(ckpt_dir: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(hub key, shape, dtype) of the tensors a pipeline checkpoint carries, for an export's shard plan."""
    path = os.path.join(ckpt_dir, CARRIED_FILE)
    if not os.path.exists(path):
        return []
    _, header = read_safetensors_header(path)
    by_offset = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])  # `iter_carried`'s order
    return [(key, tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for key, e in by_offset]


def iter_carried(ckpt_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The carried tensors one at a time, in `carried_plan` order (plain reads: no memory map of the whole file)."""
    path = os.path.join(ckpt_dir, CARRIED_FILE)
    if not os.path.exists(path):
        return
    yield from iter_safetensors(path)  # by offset: the order the file was written in, `carried_plan`'s
