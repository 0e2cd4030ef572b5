"""Hugging Face checkpoint -> DeepSpeed pipeline checkpoint, streamed one layer at a time.

Output (`CKPT_DIR`):

    latest                                  "global_step0"
    global_step0/layer_XX-model_00-model_states.pt   one per pipeline layer (see models.pipe_layout)
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
import time
from collections.abc import Callable

import torch

from checkpoint.buffer_pool import BufferPool
from checkpoint.dequantize import is_quantized, plain_tensors
from checkpoint.dtypes import DTYPES, dtype_name
from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import read_model_config, stored_dtype
from checkpoint.layer_files import find_layer_file, unchecked_zip_records
from checkpoint.manifest import BackgroundDescriber, copy_verified, read_manifest
from checkpoint.names import CARRIED_FILE, PIECE_FILE, layer_file_name
from checkpoint.outputs import PIPELINE, check_output
from checkpoint.source_checks import SourceCheck, check_keys
from checkpoint.staging import staged_directory
from checkpoint.writer import TAG, ConvertStats, check_tp, finish_converted, finish_piece, own_storage, write_layer
from common.progress import Progress
from models.config import read_config_fields
from models.families import family_of
from models.hub_names import memory_key
from models.key_table import all_layer_keys, hf_key_to_layer, hub_index
from models.pipe_layout import pipe_layers


def convert_layers(
    hf_dir: str,
    step_dir: str,
    todo: list[int],
    dtype: str | None,
    fmt: str = "pt",
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
    config=None,
    between_layers: Callable[[int, int], None] | None = None,
) -> ConvertStats:
    """Write the layer files of `todo` (pipeline layer indices), reading only the tensors they need; with
    `tp_size` > 1 each layer is split the moment it is complete (TP ranks `tp_ranks`, default all).
    `config`: the model's (default: read from hf_dir); `between_layers(1, bytes written)` runs after each layer
    (it may raise)."""
    config = config or read_model_config(hf_dir)
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    expected = all_layer_keys(config)
    wanted = {hf for index in todo for hf in expected[index].values()}
    index_of = hub_index(config)
    stats = ConvertStats()
    pending: dict[int, dict[str, torch.Tensor]] = {}
    pending_bytes = 0
    describer, pool = BackgroundDescriber(), BufferPool()
    with torch.inference_mode(), unchecked_zip_records():
        # Quantized weights (FP8, MXFP4) arrive dequantized (checkpoint/dequantize.py).
        for name, tensor in plain_tensors(hf_dir, config, wanted, DTYPES[dtype or "bf16"], pool):
            index, ours = hf_key_to_layer(name, config, index_of)
            # stays fp32 as transformers keeps it in this dtype (a router's score bias; fp16: V3.2's weights_proj)
            keep = family_of(config).keeps_fp32(memory_key(config, name), DTYPES[dtype or "bf16"])  # (by its own name)
            if dtype and tensor.is_floating_point() and tensor.dtype != DTYPES[dtype] and not keep:
                cast = pool.take(tensor.numel() * DTYPES[dtype].itemsize).view(DTYPES[dtype]).view(tensor.shape)
                cast.copy_(tensor)
                pool.give(tensor)
                tensor = cast
            elif dtype and keep and tensor.is_floating_point() and tensor.dtype != torch.float32:
                upcast = tensor.float()  # as transformers loads it, from bf16 too
                pool.give(tensor)
                tensor = upcast
            tensor = own_storage(tensor)
            pending.setdefault(index, {})[ours] = tensor
            pending_bytes += tensor.numel() * tensor.element_size()
            stats.peak_pending_bytes = max(stats.peak_pending_bytes, pending_bytes)
            stats.tensors += 1
            if len(pending[index]) == len(expected[index]):
                layer = pending.pop(index)
                paths = write_layer(step_dir, layers[index], layer, fmt, config.vocab_size, tp_size, tp_ranks, config)
                pending_bytes -= sum(t.numel() * t.element_size() for t in layer.values())
                for t in layer.values():
                    pool.give(t)
                del t  # NOTE: else it holds the layer's last tensor (an embedding: 750 MB) until the next is written
                nbytes = sum(os.path.getsize(path) for path in paths)
                stats.bytes_written += nbytes
                stats.layers_written += 1
                stats.files += [os.path.basename(path) for path in paths]
                for path, hashed in paths.items():
                    describer.add(path, hashed)
                del layer
                if between_layers:
                    between_layers(1, nbytes)
    stats.manifest = describer.entries()
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
    hf_dir: str,
    step_dir: str,
    todo: list[int],
    dtype: str | None,
    workers: int,
    fmt: str,
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
    config=None,
    between_layers: Callable[[int, int], None] | None = None,
) -> ConvertStats:
    """`convert_layers` in `workers` processes; `between_layers(layers, bytes)` runs as each group finishes."""
    if workers <= 1:
        return convert_layers(hf_dir, step_dir, todo, dtype, fmt, tp_size, tp_ranks, config, between_layers)
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    stats = ConvertStats()
    ctx = mp.get_context("spawn")  # NOTE: no forked copies of torch/OMP state
    groups = _split(todo, workers)
    with ProcessPoolExecutor(max_workers=len(groups), mp_context=ctx) as pool:
        jobs = [(hf_dir, step_dir, g, dtype, fmt, tp_size, tp_ranks, config) for g in groups]
        for part in pool.map(convert_layers, *zip(*jobs)):
            stats.layers_written += part.layers_written
            stats.tensors += part.tensors
            stats.bytes_written += part.bytes_written
            stats.peak_pending_bytes += part.peak_pending_bytes  # workers hold their layers at the same time
            stats.files += part.files
            stats.manifest.update(part.manifest)
            if between_layers:
                between_layers(part.layers_written, part.bytes_written)
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


def convert_hf_to_pipeline(
    hf_dir: str,
    out_dir: str,
    dtype: str | None = None,
    force: bool = False,
    log=print,
    layers: list[int] | None = None,
    workers: int = 1,
    fmt: str = "pt",
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
) -> ConvertStats:
    """Convert a Hugging Face checkpoint of a supported family into pipeline layer files. See the module docstring.

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
        tp_size: write each layer as this many tensor-parallel shards (`layer_XX-model_YY`).
        tp_ranks: write only these TP ranks' files: a piece (e.g. each node converts its own ranks).

    Raises:
        CheckpointError: bad input; nothing has been written to `out_dir`.
    """
    start = time.perf_counter()
    check_output(out_dir, PIPELINE, force, [("input", hf_dir)])
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    try:
        light = read_config_fields(hf_dir)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    source = SourceCheck(hf_dir)
    config = source.result(light, tokenizer=False)  # the layer files' keys come from transformers' own layers
    expected = check_keys(hf_dir, config)
    check_tp(config, tp_size, tp_ranks)
    whole = layers is None and (tp_ranks is None or sorted(tp_ranks) == list(range(tp_size)))
    todo = sorted(expected) if layers is None else sorted(layers)
    if set(todo) - set(expected):
        raise CheckpointError(f"{hf_dir}: no layer file {sorted(set(todo) - set(expected))} in this model")
    dtype = dtype or ("bf16" if is_quantized(config) else None)  # FP8 and MXFP4 become bf16 unless --dtype says
    out_dtype = dtype or dtype_name(stored_dtype(hf_dir))
    with staged_directory(out_dir, force, PIPELINE, "convert", [hf_dir]) as tmp:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        if workers > 1:  # worker processes: the checks first (the parent only waits for them)
            source.result(light)
        with Progress("converting", len(todo)) as progress:

            def after(layers: int, nbytes: int) -> None:
                source.raise_if_failed()
                progress.update(layers, nbytes)

            stats = _run_workers(hf_dir, step_dir, todo, dtype, workers, fmt, tp_size, tp_ranks, config, after)
        source.result(light)  # before anything is published
        if whole:
            finish_converted(tmp, hf_dir, out_dtype, dtype, known=stats.manifest)
        else:
            finish_piece(tmp, hf_dir, todo, out_dtype, dtype, tp_size, tp_ranks, known=stats.manifest)
    stats.seconds = time.perf_counter() - start
    what = "converted" if whole else "piece with"
    log(
        f"{what} {hf_dir} -> {out_dir}: {stats.layers_written} layer files, {stats.tensors} tensors, "
        f"{stats.bytes_written / 2**20:.1f} MiB in {stats.seconds:.1f}s with {workers} worker(s) "
        f"(largest set of tensors held at once {stats.peak_pending_bytes / 2**20:.1f} MiB)"
    )
    return stats


def _arch(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}


def combine_pieces(pieces: list[str], out_dir: str, force: bool = False, log=print) -> str:
    """Join pieces written with `--layers`, `--stages` or `--tp-ranks` (possibly on several machines) into one
    checkpoint; every layer file of every tensor-parallel rank must be in exactly one piece."""
    check_output(out_dir, PIPELINE, force, [("piece", p) for p in pieces])
    config = read_model_config(pieces[0])
    expected = set(all_layer_keys(config))
    owner: dict[tuple[int, int], str] = {}  # (layer index, TP rank) -> piece
    dtypes, tp_sizes = set(), set()
    for piece in pieces:
        path = os.path.join(piece, PIECE_FILE)
        if not os.path.exists(path):
            raise CheckpointError(f"{piece}: not a piece (no {PIECE_FILE}); write pieces with --layers or --stages")
        with open(path) as f:
            info = json.load(f)
        if _arch(read_model_config(piece)) != _arch(config):
            raise CheckpointError(f"{piece}/config.json: a different model than {pieces[0]}")
        tp_size = info.get("tp_size", 1)
        for index in info["layers"]:
            for tp_rank in info.get("tp_ranks", [0]):
                if (index, tp_rank) in owner:
                    rank = f" (TP rank {tp_rank})" if tp_size > 1 else ""
                    raise CheckpointError(f"{piece}: layer {index}{rank} is also in {owner[index, tp_rank]}")
                owner[index, tp_rank] = piece
        dtypes.add(info["dtype"])
        tp_sizes.add(tp_size)
    if len(tp_sizes) > 1:
        raise CheckpointError(f"pieces were written with different --tp {sorted(tp_sizes)}")
    tp_size = tp_sizes.pop()
    missing = sorted((i, r) for i in expected for r in range(tp_size) if (i, r) not in owner)
    if missing:
        what = sorted({i for i, _ in missing}) if tp_size == 1 else [layer_file_name(i, r) for i, r in missing][:4]
        raise CheckpointError(f"pieces {pieces} lack layer files {what}")
    if len(dtypes) > 1:
        raise CheckpointError(f"pieces were written with different dtypes {sorted(dtypes)}")
    with staged_directory(out_dir, force, PIPELINE, "--combine", pieces) as tmp:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        manifests = {piece: read_manifest(os.path.join(piece, TAG)) for piece in pieces}
        known = {}
        for (index, tp_rank), piece in sorted(owner.items()):
            src = find_layer_file(os.path.join(piece, TAG), index, tp_rank)
            entry = manifests[piece].get(os.path.basename(src)) if src else None
            if entry is None:
                raise CheckpointError(f"{os.path.join(piece, TAG)}: layer {index} missing from its piece or manifest")
            copy_verified(src, step_dir, entry)  # pieces travel between machines: check them as they are copied
            known[os.path.basename(src)] = entry
        carrier = next((p for p in pieces if os.path.exists(os.path.join(p, CARRIED_FILE))), pieces[0])
        finish_converted(tmp, pieces[0], dtypes.pop(), known=known, carried_from=carrier)
    log(f"combined {len(pieces)} pieces -> {out_dir}: {len(owner)} layer files")
    return out_dir
