"""Conversion at load time: `model_name_or_path` may be a Hugging Face model directory.

The first DP rank of every pipeline stage converts exactly the layers its stage owns, all stages at
the same time, into `output_dir/hf_converted/`; rank 0 then adds the engine metadata, `latest`,
config/tokenizer files and the manifest, and renames the directory into place. Why this split:
stages work in parallel and each reads only the shards its layers live in, DP replicas hold the
same layers so one converter per stage is enough, and it needs nothing beyond the shared
`output_dir` that checkpoints already require (no node-local assumptions). `conversion.json`
records the source (path, file sizes and times); a later run with the same source reuses the
files, a changed source is converted again.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

from checkpoint.convert import (
    TAG,
    convert_layers,
    copy_side_files,
    engine_metadata,
    load_llama_config,
    plan_conversion,
)
from checkpoint.hf_reader import CheckpointError, list_shards, stored_dtype
from checkpoint.manifest import build_manifest, write_manifest
from models.layout import all_layer_keys

CONVERTED = "hf_converted"
RECORD = "conversion.json"


def is_hf_dir(path: str) -> bool:
    """An HF model directory (weights + config.json), not a pipeline checkpoint (which has `latest`)."""
    if not os.path.exists(os.path.join(path, "config.json")) or os.path.exists(os.path.join(path, "latest")):
        return False
    try:
        list_shards(path)
    except CheckpointError:
        return False
    return True


def source_record(hf_dir: str) -> dict:
    shards, _ = list_shards(hf_dir)
    files = {}
    for name in [*shards, "config.json"]:
        path = os.path.join(hf_dir, name)
        if os.path.exists(path):
            st = os.stat(path)
            files[name] = [st.st_size, int(st.st_mtime)]
    return {"source": os.path.abspath(hf_dir), "files": files}


def _agree(error: str | None) -> None:
    """Every rank learns whether any rank failed; all raise the first message (no rank left waiting)."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)


def convert_on_load(
    hf_dir: str, output_dir: str, rank: int, stage: int, dp_rank: int, bounds: list[int]
) -> tuple[str, bool]:
    """Convert (or reuse) `hf_dir` for this run. Collective. Returns (checkpoint directory, reused)."""
    final = os.path.join(output_dir, CONVERTED)
    record = source_record(hf_dir)
    record_path = os.path.join(final, RECORD)
    if os.path.exists(record_path):
        with open(record_path) as f:
            if json.load(f) == record:
                return final, True
    tmp = os.path.join(output_dir, f".{CONVERTED}.tmp")
    error = None
    if rank == 0:
        try:
            plan_conversion(hf_dir)  # every check of convert2ckpt.py, before anything is written
            shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted conversion
            os.makedirs(os.path.join(tmp, TAG))
        except CheckpointError as e:
            error = str(e)
    _agree(error)
    expected = all_layer_keys(load_llama_config(hf_dir))  # rank 0 has validated everything already
    mine = [i for i in range(bounds[stage], bounds[stage + 1]) if i in expected]
    error = None
    if dp_rank == 0 and mine:
        try:
            convert_layers(hf_dir, os.path.join(tmp, TAG), mine, None)
        except (CheckpointError, OSError) as e:
            error = f"stage {stage}: {e}"
    _agree(error)
    if rank == 0:
        step_dir = os.path.join(tmp, TAG)
        dtype = str(stored_dtype(hf_dir)).removeprefix("torch.")
        torch.save(engine_metadata(dtype), os.path.join(step_dir, "mp_rank_00_model_states.pt"))
        with open(os.path.join(tmp, "latest"), "w") as f:
            f.write(TAG)
        copy_side_files(hf_dir, tmp, None)
        write_manifest(step_dir, build_manifest(step_dir))
        with open(os.path.join(tmp, RECORD), "w") as f:
            json.dump(record, f, indent=2)
        shutil.rmtree(final, ignore_errors=True)  # a conversion of an older source
        os.replace(tmp, final)
    dist.barrier()
    return final, False
