"""What makes a directory a pipeline checkpoint: layer files, engine metadata, `latest`, side files, manifest.

Shared by every command that writes one (conversion from Hugging Face, `--combine`, `--tp` resharding,
conversion at load time) and by the export's side files, so none of them needs the Hugging Face converter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from checkpoint.carried import carry
from checkpoint.dtypes import DTYPES, dtype_name
from checkpoint.errors import CheckpointError
from checkpoint.layer_files import layer_path, save_layer_state
from checkpoint.manifest import build_manifest, write_manifest
from checkpoint.names import (
    CONTAINER_CONFIG,
    CONVERSION_RECORD,
    CONVERTED_TAG,
    LATEST,
    MODEL_SIDE_FILES,
    PIECE_FILE,
    engine_file,
)
from checkpoint.outputs import copy_from_input
from models.families import tp_refusal
from models.pipe_layout import PipeLayer
from models.sharding import shard, tp_indivisible
from models.tp_rules import tp_split

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
NOT_COPIED = (PIECE_FILE, CONVERSION_RECORD)  # records of how a directory was made, not model files
TAG = CONVERTED_TAG  # the one tag of a converted checkpoint


@dataclass
class ConvertStats:
    layers_written: int = 0
    tensors: int = 0
    bytes_written: int = 0
    peak_pending_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    manifest: dict[str, dict] = field(default_factory=dict)  # entries of the files written, described meanwhile


def copy_side_files(src_dir: str, dst_dir: str, dtype: str | None, model_files_only: bool | None = None) -> None:
    """Copy config/tokenizer files (of an HF directory: everything but weights; of a pipeline checkpoint or a
    trainer's output_dir, or with `model_files_only`: the model files only, not metrics and logs); record a
    cast dtype in config.json."""
    if model_files_only is None:
        model_files_only = os.path.exists(os.path.join(src_dir, LATEST))
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if (
            os.path.isfile(src)
            and not name.endswith(WEIGHT_SUFFIXES)
            and not name.startswith(".")
            and name not in NOT_COPIED
            and (not model_files_only or name in MODEL_SIDE_FILES)
        ):
            copy_from_input(src, os.path.join(dst_dir, name), src_dir)
    text_model_config(os.path.join(dst_dir, "config.json"))
    if dtype:
        record_dtype(os.path.join(dst_dir, "config.json"), dtype)


def text_model_config(config_path: str) -> None:
    """A container checkpoint's config.json (models/families/ `CONTAINERS`) replaced by its text model's: what
    conversion takes of it, and what an export of the trained model is."""
    from models.config import text_config_json

    if not os.path.exists(config_path):
        return
    with open(config_path) as f:
        conf = json.load(f)
    text = text_config_json(conf)
    if text is not conf:  # the container's own config kept beside: exports write the hub's layout back
        with open(os.path.join(os.path.dirname(config_path), CONTAINER_CONFIG), "w") as f:
            json.dump(conf, f, indent=2)
        with open(config_path, "w") as f:
            json.dump(text, f, indent=2)


def record_dtype(config_path: str, dtype: str) -> None:
    """Write a cast dtype into config.json (`dtype`, the transformers 5 key; the old `torch_dtype` dropped). The
    files hold plain tensors of that dtype: an FP8 source's `quantization_config` goes (checkpoint/dequantize.py)."""
    with open(config_path) as f:
        conf = json.load(f)
    conf["dtype"] = dtype_name(DTYPES[dtype])
    conf.pop("torch_dtype", None)
    conf.pop("quantization_config", None)
    with open(config_path, "w") as f:
        json.dump(conf, f, indent=2)


def engine_metadata(dtype: str) -> dict:
    """What DeepSpeed's `load_checkpoint` reads from `mp_rank_00_model_states.pt`; weights live in layer files."""
    from importlib.metadata import version

    return {
        "module": None,
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "skipped_steps": 0,
        "global_steps": 0,
        "global_samples": 0,
        "dp_world_size": 1,
        "mp_world_size": 1,
        "ds_version": version("deepspeed"),  # NOTE: not `import deepspeed`: a second of start-up per conversion
        "converted_from_hf": True,
        "dtype": dtype,
    }


def finish_converted(
    root: str,
    side_files_from: str,
    dtype: str,
    cast: str | None = None,
    known: dict[str, dict] | None = None,
    carried_from: str | None = None,
) -> None:
    """Make `root` (whose `global_step0/` holds every layer file) a complete converted checkpoint:
    engine metadata, `latest`, config and tokenizer files, the hub tensors it carries (from `carried_from`, default
    `side_files_from`: checkpoint/carried.py), manifest (files in `known` are not hashed again). Used by
    conversion, `--combine`, resharding and conversion at load time."""
    step_dir = os.path.join(root, TAG)
    torch.save(engine_metadata(dtype), os.path.join(step_dir, engine_file(0)))
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(TAG)
    copy_side_files(side_files_from, root, cast)
    carry(carried_from or side_files_from, root)
    write_manifest(step_dir, build_manifest(step_dir, known=known))


def finish_piece(
    root: str,
    source: str,
    layers: list[int],
    dtype: str,
    cast: str | None = None,
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
    known: dict[str, dict] | None = None,
) -> None:
    """Make `root` a piece: some layers or some TP ranks, no `latest` (nothing mistakes it for a whole
    checkpoint); `piece.json` says which, for `--combine` and for a trainer that loads its own ranks from it."""
    ranks = list(range(tp_size)) if tp_ranks is None else sorted(tp_ranks)
    info = {"layers": layers, "dtype": dtype, "source": os.path.abspath(source), "tp_size": tp_size, "tp_ranks": ranks}
    with open(os.path.join(root, PIECE_FILE), "w") as f:
        json.dump(info, f)
    copy_side_files(source, root, cast)
    if 0 in layers:  # the piece with the embedding carries the hub's untrained tensors (`--combine` finds it)
        carry(source, root)
    step_dir = os.path.join(root, TAG)
    write_manifest(step_dir, build_manifest(step_dir, known=known))


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: give each tensor its own."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def write_layer(
    step_dir: str,
    layer: PipeLayer,
    state: dict[str, torch.Tensor],
    fmt: str,
    vocab_size: int,
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
    config=None,
) -> dict[str, str | None]:
    """Write one layer as the files of TP ranks `tp_ranks` (default all) of `tp_size`; returns {path: its hash, or
    None where not computed on the way out}. `config`: the model's (a fused q/k/v projection's split needs it)."""
    paths = {}
    for tp_rank in range(tp_size) if tp_ranks is None else tp_ranks:
        part = (
            state
            if tp_size == 1
            else {k: shard(v, tp_split(layer.kind, k, config), tp_rank, tp_size, vocab_size) for k, v in state.items()}
        )
        path = layer_path(step_dir, layer.index, fmt, tp_rank)
        paths[path] = save_layer_state(part, path)
    return paths


def check_tp(config, tp_size: int, tp_ranks: list[int] | None) -> None:
    """`--tp` must divide the heads, KV heads and MLP width; `--tp-ranks` must be ranks of it."""
    refused = tp_refusal(config, tp_size)
    if refused:
        raise CheckpointError(f"--tp {tp_size}: {refused}")
    bad = tp_indivisible(config, tp_size)
    if bad:
        raise CheckpointError(f"--tp {tp_size}: must divide {bad[0]}={bad[1]}")
    bad = [r for r in tp_ranks or [] if not 0 <= r < tp_size]
    if bad:
        raise CheckpointError(f"--tp-ranks: rank {bad[0]} is not one of 0..{tp_size - 1} (--tp {tp_size})")
