"""Hugging Face checkpoint -> DeepSpeed pipeline checkpoint, streamed one layer at a time.

Output (`CKPT_DIR`):

    latest                                  "global_step0"
    global_step0/layer_XX-model_00-model_states.pt   one per pipeline layer (see models.layout)
    global_step0/mp_rank_00_model_states.pt          DeepSpeed's engine metadata, no weights
    config.json, generation_config.json, tokenizer files   copied from the HF directory

Peak memory is the tensors of the layers not yet complete: with shards in index order that is
about one layer (plus the embedding, which is a layer of its own). Everything is written to a
temporary sibling directory and renamed into place at the end (`checkpoint.staging`), so an
interrupted conversion leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field

import torch

from checkpoint.dtypes import DTYPES, dtype_name
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import iter_tensors, read_model_config, stored_dtype, validate
from checkpoint.layer_files import find_layer_file, layer_path, save_layer_state
from checkpoint.manifest import build_manifest, write_manifest
from checkpoint.names import CONVERSION_RECORD, CONVERTED_TAG, LATEST, PIECE_FILE, engine_file
from checkpoint.staging import staged_directory
from models.layout import all_layer_keys, hf_key_to_layer
from models.tokenizer import check_tokenizer_fits, has_tokenizer, load_tokenizer

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
NOT_COPIED = (PIECE_FILE, CONVERSION_RECORD)  # records of how a directory was made, not model files
TAG = CONVERTED_TAG


@dataclass
class ConvertStats:
    layers_written: int = 0
    tensors: int = 0
    bytes_written: int = 0
    peak_pending_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


def check_tokenizer(hf_dir: str, vocab_size: int) -> int | None:
    """len(tokenizer) must not exceed the embedding rows. Returns len(tokenizer), None if there is none."""
    if not has_tokenizer(hf_dir):
        return None
    try:
        n = len(load_tokenizer(hf_dir, setting="tokenizer"))
        check_tokenizer_fits(n, vocab_size, hf_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return n


def copy_side_files(src_dir: str, dst_dir: str, dtype: str | None) -> None:
    """Copy config/tokenizer files (everything but weights); record a cast dtype in config.json."""
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES) and not name.startswith(".") \
                and name not in NOT_COPIED:  # fmt: skip
            shutil.copy2(src, os.path.join(dst_dir, name))
    if dtype:
        record_dtype(os.path.join(dst_dir, "config.json"), dtype)


def record_dtype(config_path: str, dtype: str) -> None:
    """Write a cast dtype into config.json (`dtype`, the transformers 5 key; the old `torch_dtype` dropped)."""
    with open(config_path) as f:
        conf = json.load(f)
    conf["dtype"] = dtype_name(DTYPES[dtype])
    conf.pop("torch_dtype", None)
    with open(config_path, "w") as f:
        json.dump(conf, f, indent=2)


def engine_metadata(dtype: str) -> dict:
    """What DeepSpeed's `load_checkpoint` reads from `mp_rank_00_model_states.pt`; weights live in layer files."""
    import deepspeed

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
        "ds_version": deepspeed.__version__,
        "converted_from_hf": True,
        "dtype": dtype,
    }


def finish_converted(root: str, side_files_from: str, dtype: str, cast: str | None = None) -> None:
    """Make `root` (whose `global_step0/` holds every layer file) a complete converted checkpoint:
    engine metadata, `latest`, config and tokenizer files, manifest. Used by conversion, `--combine`
    and conversion at load time."""
    step_dir = os.path.join(root, TAG)
    torch.save(engine_metadata(dtype), os.path.join(step_dir, engine_file(0)))
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(TAG)
    copy_side_files(side_files_from, root, cast)
    write_manifest(step_dir, build_manifest(step_dir))


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: give each tensor its own."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def convert_layers(hf_dir: str, step_dir: str, todo: list[int], dtype: str | None, fmt: str = "pt") -> ConvertStats:
    """Write the layer files of `todo` (pipeline layer indices), reading only the tensors they need."""
    config = read_model_config(hf_dir)
    n_layers, tied = config.num_hidden_layers, config.tie_word_embeddings
    expected = all_layer_keys(config)
    wanted = {hf for index in todo for hf in expected[index].values()}
    stats = ConvertStats()
    pending: dict[int, dict[str, torch.Tensor]] = {}
    pending_bytes = 0
    with torch.inference_mode():
        for name, tensor, _ in iter_tensors(hf_dir, wanted):
            index, ours = hf_key_to_layer(name, n_layers, tied)
            if dtype and tensor.is_floating_point():
                tensor = tensor.to(DTYPES[dtype])
            tensor = _own_storage(tensor)
            pending.setdefault(index, {})[ours] = tensor
            pending_bytes += tensor.numel() * tensor.element_size()
            stats.peak_pending_bytes = max(stats.peak_pending_bytes, pending_bytes)
            stats.tensors += 1
            if len(pending[index]) == len(expected[index]):
                layer = pending.pop(index)
                path = layer_path(step_dir, index, fmt)
                save_layer_state(layer, path)
                pending_bytes -= sum(t.numel() * t.element_size() for t in layer.values())
                stats.bytes_written += os.path.getsize(path)
                stats.layers_written += 1
                stats.files.append(os.path.basename(path))
                del layer
    if pending:  # duplicates across shards or a key listed twice would land here
        raise CheckpointError(f"{hf_dir}: layers {sorted(pending)} incomplete after reading every shard")
    return stats


def _split(todo: list[int], parts: int) -> list[list[int]]:
    """Contiguous groups of layers, as even as possible (layers of a group share shards)."""
    parts = max(1, min(parts, len(todo)))
    size, extra = divmod(len(todo), parts)
    groups, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        groups.append(todo[start:end])
        start = end
    return groups


def _run_workers(
    hf_dir: str, step_dir: str, todo: list[int], dtype: str | None, workers: int, fmt: str
) -> ConvertStats:
    if workers <= 1:
        return convert_layers(hf_dir, step_dir, todo, dtype, fmt)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    stats = ConvertStats()
    ctx = mp.get_context("spawn")  # NOTE: no forked copies of torch/OMP state
    groups = _split(todo, workers)
    with ProcessPoolExecutor(max_workers=len(groups), mp_context=ctx) as pool:
        for part in pool.map(convert_layers, *zip(*[(hf_dir, step_dir, g, dtype, fmt) for g in groups])):
            stats.layers_written += part.layers_written
            stats.tensors += part.tensors
            stats.bytes_written += part.bytes_written
            stats.peak_pending_bytes += part.peak_pending_bytes  # workers hold their layers at the same time
            stats.files += part.files
    return stats


def parse_layer_range(text: str, valid: list[int]) -> list[int]:
    """'0-7', '3', '0-3,9' -> sorted pipeline layer indices, checked against `valid`."""
    layers: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise CheckpointError(f"--layers {text}: expected ranges like 0-7,9") from None
        if last < first:
            raise CheckpointError(f"--layers {text}: {part.strip()} is an empty range (write it low-high)")
        layers.update(range(first, last + 1))
    bad = sorted(layers - set(valid))
    if bad:
        raise CheckpointError(
            f"--layers {text}: no pipeline layer {bad[0]} in this model (layer files: {valid[0]}..{valid[-1]})"
        )
    return sorted(layers)


def plan_conversion(hf_dir: str):
    """Every check before a conversion writes anything. Returns (config, {layer index: {ours: HF key}}).

    Raises:
        CheckpointError: config, tokenizer, shards or keys do not fit the LLaMA layout.
    """
    config = read_model_config(hf_dir)
    check_tokenizer(hf_dir, config.vocab_size)
    n_layers, tied = config.num_hidden_layers, config.tie_word_embeddings
    # Every HF key must have a home and every home a key.
    where = validate(hf_dir)
    expected = all_layer_keys(config)
    for name, shard in where.items():
        try:
            hf_key_to_layer(name, n_layers, tied)
        except KeyError as e:
            raise CheckpointError(f"{os.path.join(hf_dir, shard)}: {e.args[0]}") from None
    missing = [hf for keys in expected.values() for hf in keys.values() if hf not in where]
    if missing:
        raise CheckpointError(f"{hf_dir}: {len(missing)} LLaMA tensors missing from the checkpoint, e.g. {missing[0]}")
    return config, expected


def convert_hf_to_pipeline(
    hf_dir: str,
    out_dir: str,
    dtype: str | None = None,
    force: bool = False,
    log=print,
    layers: list[int] | None = None,
    workers: int = 1,
    fmt: str = "pt",
) -> ConvertStats:
    """Convert an HF LLaMA checkpoint into the pipeline layout. See the module docstring.

    Args:
        hf_dir: directory with config.json, weights and (optionally) tokenizer files.
        out_dir: checkpoint directory to create.
        dtype: "fp32", "bf16" or "fp16" to cast floating tensors; None keeps the stored dtype.
        force: replace an existing output directory.
        log: where progress lines go.
        layers: convert only these pipeline layers: the output is a *piece* (no `latest`) that
            `combine_pieces` joins with the others into one checkpoint.
        workers: processes converting disjoint groups of layers at once (memory: one layer each).
        fmt: layer file format, "pt" (what DeepSpeed writes) or "safetensors"; both load everywhere.

    Raises:
        CheckpointError: bad input; nothing has been written to `out_dir`.
    """
    start = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    config, expected = plan_conversion(hf_dir)
    todo = sorted(expected) if layers is None else sorted(layers)
    if set(todo) - set(expected):
        raise CheckpointError(f"{hf_dir}: no layer file {sorted(set(todo) - set(expected))} in this model")
    out_dtype = dtype or dtype_name(stored_dtype(hf_dir))
    with staged_directory(out_dir, force) as tmp:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        stats = _run_workers(hf_dir, step_dir, todo, dtype, workers, fmt)
        if layers is None:
            finish_converted(tmp, hf_dir, out_dtype, dtype)
        else:  # a piece: no `latest`, so nothing mistakes it for a whole checkpoint
            with open(os.path.join(tmp, PIECE_FILE), "w") as f:
                json.dump({"layers": todo, "dtype": out_dtype, "source": os.path.abspath(hf_dir)}, f)
            copy_side_files(hf_dir, tmp, dtype)
            write_manifest(step_dir, build_manifest(step_dir))
    stats.seconds = time.perf_counter() - start
    what = "piece with" if layers is not None else "converted"
    log(
        f"{what} {hf_dir} -> {out_dir}: {stats.layers_written} layer files, {stats.tensors} tensors, "
        f"{stats.bytes_written / 2**20:.1f} MiB in {stats.seconds:.1f}s with {workers} worker(s) "
        f"(largest set of tensors held at once {stats.peak_pending_bytes / 2**20:.1f} MiB)"
    )
    return stats


def _arch(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}


def combine_pieces(pieces: list[str], out_dir: str, force: bool = False, log=print) -> str:
    """Join pieces written with `layers=` (possibly on several machines) into one checkpoint."""
    config = read_model_config(pieces[0])
    expected = set(all_layer_keys(config))
    owner: dict[int, str] = {}
    dtypes = set()
    for piece in pieces:
        path = os.path.join(piece, PIECE_FILE)
        if not os.path.exists(path):
            raise CheckpointError(f"{piece}: not a piece (no {PIECE_FILE}); write pieces with --layers or --stages")
        with open(path) as f:
            info = json.load(f)
        if _arch(read_model_config(piece)) != _arch(config):
            raise CheckpointError(f"{piece}/config.json: a different model than {pieces[0]}")
        for index in info["layers"]:
            if index in owner:
                raise CheckpointError(f"{piece}: layer {index} is also in {owner[index]}")
            owner[index] = piece
        dtypes.add(info["dtype"])
    missing = sorted(expected - set(owner))
    if missing:
        raise CheckpointError(f"pieces {pieces} lack layer files {missing}")
    if len(dtypes) > 1:
        raise CheckpointError(f"pieces were written with different dtypes {sorted(dtypes)}")
    with staged_directory(out_dir, force) as tmp:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        for index, piece in sorted(owner.items()):
            src = find_layer_file(os.path.join(piece, TAG), index)
            if src is None:
                raise CheckpointError(f"{os.path.join(piece, TAG)}: layer {index} missing from its piece")
            shutil.copy2(src, step_dir)
        finish_converted(tmp, pieces[0], dtypes.pop())
    log(f"combined {len(pieces)} pieces -> {out_dir}: {len(owner)} layer files")
    return out_dir
