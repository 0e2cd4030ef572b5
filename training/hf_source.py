"""Conversion at load time: `model_name_or_path` may be a Hugging Face model directory.

The first DP and TP rank of every pipeline stage converts exactly the layers its stage owns (whole,
TP=1 files that each TP rank slices at load), all stages at the same time, into
`output_dir/hf_converted/`; rank 0 then adds the engine metadata, `latest`, config/tokenizer files
and the manifest, and renames the directory into place. Why this split: stages work in parallel and
each reads only the shards its layers live in; DP replicas and TP ranks hold the same layers, so one
converter per stage is enough (several writers of one file would race); and it needs nothing beyond
the shared `output_dir` that checkpoints already require (no node-local assumptions).
`conversion.json` records the source (path, file sizes and times); a later run with the same source
reuses the files, a changed source is converted again.
"""

from __future__ import annotations

import json
import os
import shutil

from checkpoint.convert import convert_layers
from checkpoint.dequantize import is_quantized
from checkpoint.dtypes import dtype_name
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import list_shards, read_model_config, stored_dtype
from checkpoint.names import CONVERSION_RECORD, CONVERTED_DIR
from checkpoint.source_checks import plan_conversion
from checkpoint.staging import publish_dir
from checkpoint.writer import TAG, finish_converted
from models.key_table import all_layer_keys
from models.partition import rank_layers
from training.distributed import agreed
from training.topology import Coords


def source_record(hf_dir: str) -> dict:
    shards, _ = list_shards(hf_dir)
    files = {}
    for name in [*shards, "config.json"]:
        path = os.path.join(hf_dir, name)
        if os.path.exists(path):
            st = os.stat(path)
            files[name] = [st.st_size, int(st.st_mtime)]
    return {"source": os.path.abspath(hf_dir), "files": files}


def convert_on_load(
    hf_dir: str, output_dir: str, coords: Coords, bounds: list[int], name: str = CONVERTED_DIR
) -> tuple[str, bool]:
    """Convert (or reuse) `hf_dir` for this run into `output_dir/name`. Collective. Returns (checkpoint directory,
    reused)."""
    final = os.path.join(output_dir, name)
    record_path = os.path.join(final, CONVERSION_RECORD)
    with agreed():
        record = source_record(hf_dir)
    if os.path.exists(record_path):
        with open(record_path) as f:
            if json.load(f) == record:
                return final, True
    tmp = os.path.join(output_dir, f".{name}.tmp")  # a fixed name: every rank writes into it
    with agreed():
        if coords.rank == 0:
            plan_conversion(hf_dir)  # every check of convert2ckpt.py, before anything is written
            shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted conversion
            os.makedirs(os.path.join(tmp, TAG))
    config = read_model_config(hf_dir)  # rank 0 has validated everything already
    expected = all_layer_keys(config)
    cast = "bf16" if is_quantized(config) else None  # FP8, MXFP4 weights dequantized to bf16 (dequantize.py)
    mine = [i for i in rank_layers(bounds, coords.num_stages)[coords.stage] if i in expected]  # DualPipeV: two stages
    with agreed():
        if coords.data_index == 0 and coords.tp_rank == 0 and mine:  # one writer per file (TP ranks slice at load)
            try:
                convert_layers(hf_dir, os.path.join(tmp, TAG), mine, cast, config=config)
            except (OSError, CheckpointError) as e:
                raise CheckpointError(f"stage {coords.stage}: {e}") from None
    with agreed():
        if coords.rank == 0:
            finish_converted(tmp, hf_dir, cast or dtype_name(stored_dtype(hf_dir)), cast)
            with open(os.path.join(tmp, CONVERSION_RECORD), "w") as f:
                json.dump(record, f, indent=2)
            publish_dir(tmp, final)  # replaces a conversion of an older source
    return final, False
