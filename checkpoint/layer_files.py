"""Layer files in either format: DeepSpeed's `.pt` (torch.save) or `.safetensors`.

The trainer always saves `.pt` (DeepSpeed writes them); the converter can write either
(`--format`), and every reader here accepts both, so a safetensors conversion trains, exports,
inspects and verifies like a `.pt` one. `.pt` files are read with `checkpoint.safe_load`: a layer
file that holds anything but tensors is refused, never unpickled.
"""

from __future__ import annotations

import contextlib
import os

import torch
from safetensors.torch import load_file, save_file

from checkpoint.direct_io import DirectFile
from checkpoint.errors import CheckpointError
from checkpoint.hashing import new_digest
from checkpoint.names import LAYER_FILE_FORMATS, LAYOUT_FILE, PIECE_FILE, layer_file_name, parse_layer_file_name
from checkpoint.safe_load import load_pt
from models.pipe_layout import PipeLayer
from models.sharding import VOCAB, merge, padded_vocab, shard
from models.tp_rules import tp_split

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


def checkpoint_tp_size(step_dir: str) -> int:
    """The tensor-parallel degree a checkpoint was written with: `layout.json` (trainer saves) or a piece's
    record; else (a whole conversion) the highest TP rank among layer 0's files + 1, so a missing rank's
    file is an error when a layer is read (`layer_shard_files`), never a silently narrower merge. Reads no
    tensor file."""
    import json

    layout = os.path.join(step_dir, LAYOUT_FILE)
    piece = os.path.join(os.path.dirname(step_dir), PIECE_FILE)
    for path in (layout, piece):
        if os.path.exists(path):
            with open(path) as f:
                return int(json.load(f).get("tp_size", 1))
    ranks = [parsed[1] for n in os.listdir(step_dir) if (parsed := parse_layer_file_name(n)) and parsed[0] == 0]
    return max(ranks, default=0) + 1


def layer_shard_file(step_dir: str, index: int, tp_rank: int) -> str:
    """Pipeline layer `index`'s file of tensor-parallel rank `tp_rank` (CheckpointError names it if missing)."""
    path = find_layer_file(step_dir, index, tp_rank)
    if path is None:
        raise CheckpointError(f"{os.path.join(step_dir, layer_file_name(index, tp_rank))}: layer file missing")
    return path


def layer_shard_files(step_dir: str, index: int, tp_size: int) -> list[str]:
    """Pipeline layer `index`'s files for TP ranks 0..tp_size-1 (CheckpointError names a missing one)."""
    return [layer_shard_file(step_dir, index, tp_rank) for tp_rank in range(tp_size)]


def _shards(step_dir: str, layer: PipeLayer, saved_tp: int) -> list[dict[str, torch.Tensor]]:
    files = layer_shard_files(step_dir, layer.index, saved_tp)
    shards = [load_layer_state(f, mmap=True) for f in files]
    for f, s in zip(files[1:], shards[1:]):
        if set(s) != set(shards[0]):
            raise CheckpointError(f"{f}: keys differ from {os.path.basename(files[0])}'s (not shards of one layer)")
    return shards


def load_layer_whole(
    step_dir: str, layer: PipeLayer, vocab_size: int, saved_tp: int, config=None
) -> dict[str, torch.Tensor]:
    """A layer's whole tensors from the `saved_tp` files it was written as (the vocabulary without padding).
    One layer in memory; files are memory-mapped. `config`: the model's (a fused q/k/v projection's merge needs it)."""
    shards = _shards(step_dir, layer, saved_tp)
    return {k: merge([s[k] for s in shards], tp_split(layer.kind, k, config), vocab_size) for k in shards[0]}


def load_layer_shard(
    step_dir: str,
    layer: PipeLayer,
    vocab_size: int,
    saved_tp: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    vocab_multiple: int = 1,
    config=None,
) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's share of a layer, from a checkpoint written with `saved_tp` ranks.

    Written with this degree (and vocabulary padding): this rank's own file is read, nothing else.
    Otherwise the layer's shards are merged and split again (models/sharding.py).
    """
    if saved_tp == tp_size:
        state = load_layer_state(layer_shard_file(step_dir, layer.index, tp_rank), mmap=True)
        rows = padded_vocab(vocab_size, tp_size, vocab_multiple) // tp_size
        if all(v.shape[0] == rows for k, v in state.items() if tp_split(layer.kind, k, config) == VOCAB):
            return state
    whole = load_layer_whole(step_dir, layer, vocab_size, saved_tp, config)
    try:
        return {
            k: shard(v, tp_split(layer.kind, k, config), tp_rank, tp_size, vocab_size, vocab_multiple)
            for k, v in whole.items()
        }
    except ValueError as e:
        where = os.path.join(step_dir, layer_file_name(layer.index))
        raise CheckpointError(f"{where}: does not fit this model ({e})") from None


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
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise CheckpointError(f"{path}: not a layer file (expected names -> tensors)")
    return state


@contextlib.contextmanager
def layer_files_as_plain_data(checkpoint_engine):
    """Within (DeepSpeed's `load_checkpoint` of a resume): the layer files DeepSpeed reads through
    `checkpoint_engine.load` are read by `load_layer_state` instead, as plain tensor data (never unpickled) and
    memory-mapped, so a rank pages in only the tensors it keeps (with expert parallelism, its own experts of each
    sparse layer, not all E). DeepSpeed's engine and optimizer files still go through its own loader."""
    load = checkpoint_engine.load

    def plain(path, map_location=None):
        if is_layer_file(os.path.basename(path)):
            return load_layer_state(path, mmap=True)
        return load(path, map_location)

    checkpoint_engine.load = plain
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's method again


def layer_tensor_specs(path: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of a layer file without reading tensor data (header / memory map)."""
    if path.endswith(".safetensors"):
        from checkpoint.dtypes import SAFETENSORS_DTYPES
        from checkpoint.hf_reader import read_safetensors_header

        header = read_safetensors_header(path)[1]
        return {k: (tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]]) for k, e in header.items()}
    return {k: (tuple(v.shape), v.dtype) for k, v in load_layer_state(path, mmap=True).items()}


@contextlib.contextmanager
def unchecked_zip_records():
    """torch.save without a CRC-32 per zip record (torch.serialization.set_crc32_options): a third of
    torch.save's time on large tensors. What guards the files instead is the manifest's hash of each
    whole file (`--verify`); torch.load and DeepSpeed read such files as any other."""
    from torch.serialization import get_crc32_options, set_crc32_options

    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


def save_layer_state(state: dict[str, torch.Tensor], path: str) -> str | None:
    """Write a layer file; returns its hash (checkpoint/hashing.py) where computed on the way out (`.pt`), else None.
    `.pt` files go past the page cache (checkpoint/direct_io.py: a tenth of the CPU of a buffered write here)."""
    if path.endswith(".safetensors"):
        save_file({k: v.contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
        return None
    # NOTE: through a Python file object: torch.save to a path wrote about 3x slower here (its own writer).
    digest = new_digest()
    with DirectFile(path, digest) as f:
        torch.save(state, f)
    return digest.hexdigest()
