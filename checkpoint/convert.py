"""Hugging Face LLaMA checkpoint -> DeepSpeed pipeline checkpoint, streamed one layer at a time.

Output (`CKPT_DIR`):

    latest                                  "global_step0"
    global_step0/layer_XX-model_00-model_states.pt   one per pipeline layer (see models.layout)
    global_step0/mp_rank_00_model_states.pt          DeepSpeed's engine metadata, no weights
    config.json, generation_config.json, tokenizer files   copied from the HF directory

Peak memory is the tensors of the layers not yet complete: with shards in index order that is
about one layer (plus the embedding, which is a layer of its own). Everything is written to a
temporary sibling directory and renamed into place at the end, so an interrupted conversion
leaves nothing that looks like a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from checkpoint.hf_reader import CheckpointError, iter_tensors, stored_dtype, validate
from checkpoint.layer_files import find_layer_file, layer_path, save_layer_state
from checkpoint.manifest import build_manifest, write_manifest
from models.layout import all_layer_keys, hf_key_to_layer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
LLAMA_MODEL_TYPES = ("llama",)
TAG = "global_step0"


@dataclass
class ConvertStats:
    layers_written: int = 0
    tensors: int = 0
    bytes_written: int = 0
    peak_pending_bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)


def load_llama_config(hf_dir: str):
    """The checkpoint's `LlamaConfig`; errors name config.json."""
    from transformers import AutoConfig

    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing")
    try:
        with open(path) as f:
            model_type = json.load(f).get("model_type")
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if model_type not in LLAMA_MODEL_TYPES:
        raise CheckpointError(f"{path}: model_type={model_type!r} is not a LLaMA-family model {LLAMA_MODEL_TYPES}")
    return AutoConfig.from_pretrained(hf_dir)


def check_tokenizer_fits(hf_dir: str, vocab_size: int) -> int | None:
    """len(tokenizer) must not exceed the embedding rows. Returns len(tokenizer), None if there is none."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any(os.path.exists(os.path.join(hf_dir, n)) for n in names):
        return None
    n = len(AutoTokenizer.from_pretrained(hf_dir))
    if n > vocab_size:
        raise CheckpointError(
            f"{hf_dir}: tokenizer has {n} tokens but the embedding has vocab_size={vocab_size} rows "
            "(was a pad token added without resizing the model?)"
        )
    return n


def checkpoint_present(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.exists(os.path.join(path, "latest")) or any(n.startswith("global_step") for n in os.listdir(path))
    )


def prepare_output(out_dir: str, force: bool) -> str:
    """Refuse to clobber existing output unless forced; return a fresh temp dir beside `out_dir`."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)) and not force:
        what = "already holds a checkpoint" if checkpoint_present(out_dir) else "exists and is not empty"
        raise CheckpointError(f"{out_dir}: output {what}; pass --force to replace it")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent}: not writable")
    return tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)


def publish(tmp_dir: str, out_dir: str) -> None:
    """Move the finished temp dir into place; the old output (with --force) goes only after that."""
    out_dir = os.path.abspath(out_dir)
    old = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=os.path.dirname(out_dir))
        os.rename(out_dir, os.path.join(old, "x"))
    os.rename(tmp_dir, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def copy_side_files(src_dir: str, dst_dir: str, dtype: str | None) -> None:
    """Copy config/tokenizer files (everything but weights); record a cast dtype in config.json."""
    for name in sorted(os.listdir(src_dir)):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES) and not name.startswith("."):
            shutil.copy2(src, os.path.join(dst_dir, name))
    if dtype:
        record_dtype(os.path.join(dst_dir, "config.json"), dtype)


def record_dtype(config_path: str, dtype: str) -> None:
    """Write a cast dtype into config.json (`dtype`, the transformers 5 key; the old `torch_dtype` dropped)."""
    with open(config_path) as f:
        conf = json.load(f)
    conf["dtype"] = str(DTYPES[dtype]).removeprefix("torch.")
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


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: give each tensor its own."""
    t = t.contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


PIECE_FILE = "piece.json"


def convert_layers(hf_dir: str, step_dir: str, todo: list[int], dtype: str | None, fmt: str = "pt") -> ConvertStats:
    """Write the layer files of `todo` (pipeline layer indices), reading only the tensors they need."""
    config = load_llama_config(hf_dir)
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
            layers.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise CheckpointError(f"--layers {text}: expected ranges like 0-7,9") from None
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
    config = load_llama_config(hf_dir)
    check_tokenizer_fits(hf_dir, config.vocab_size)
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
    stored = stored_dtype(hf_dir)

    tmp = prepare_output(out_dir, force)
    try:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        stats = _run_workers(hf_dir, step_dir, todo, dtype, workers, fmt)
        out_dtype = dtype or str(stored).removeprefix("torch.")
        if layers is None:
            torch.save(engine_metadata(out_dtype), os.path.join(step_dir, "mp_rank_00_model_states.pt"))
            with open(os.path.join(tmp, "latest"), "w") as f:
                f.write(TAG)
        else:  # a piece: no `latest`, so nothing mistakes it for a whole checkpoint
            with open(os.path.join(tmp, PIECE_FILE), "w") as f:
                json.dump({"layers": todo, "dtype": out_dtype, "source": os.path.abspath(hf_dir)}, f)
        copy_side_files(hf_dir, tmp, dtype)
        write_manifest(step_dir, build_manifest(step_dir))
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    config = load_llama_config(pieces[0])
    expected = set(all_layer_keys(config))
    owner: dict[int, str] = {}
    dtypes = set()
    for piece in pieces:
        path = os.path.join(piece, PIECE_FILE)
        if not os.path.exists(path):
            raise CheckpointError(f"{piece}: not a piece (no {PIECE_FILE}); write pieces with --layers or --stages")
        with open(path) as f:
            info = json.load(f)
        if _arch(load_llama_config(piece)) != _arch(config):
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
    tmp = prepare_output(out_dir, force)
    try:
        step_dir = os.path.join(tmp, TAG)
        os.makedirs(step_dir)
        for index, piece in sorted(owner.items()):
            src = find_layer_file(os.path.join(piece, TAG), index)
            if src is None:
                raise CheckpointError(f"{os.path.join(piece, TAG)}: layer {index} missing from its piece")
            shutil.copy2(src, step_dir)
        torch.save(engine_metadata(dtypes.pop()), os.path.join(step_dir, "mp_rank_00_model_states.pt"))
        with open(os.path.join(tmp, "latest"), "w") as f:
            f.write(TAG)
        copy_side_files(pieces[0], tmp, None)
        os.remove(os.path.join(tmp, PIECE_FILE))
        write_manifest(step_dir, build_manifest(step_dir))
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"combined {len(pieces)} pieces -> {out_dir}: {len(owner)} layer files")
    return out_dir
