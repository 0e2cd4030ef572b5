"""Pipeline checkpoint -> Hugging Face directory (sharded safetensors), one layer file at a time.

Works on what `convert2ckpt.py` writes and on every checkpoint the trainer saves (any number of
stages: layer files are named by global layer index, not by stage). Output:

    model-00001-of-0000N.safetensors ...   shards of at most --max-shard-size, written tensor by tensor
    model.safetensors.index.json            total_size + weight_map
    config.json, generation_config.json, tokenizer files

Memory is one layer: shard headers are planned from memory-mapped layer files before any data is
read, then each shard is streamed. Like the converter it writes into a temporary sibling directory,
renames it into place at the end, and refuses to replace existing output without --force.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time

import torch

from checkpoint.carried import carried_plan, iter_carried
from checkpoint.dtypes import DTYPES, element_size
from checkpoint.errors import CheckpointError
from checkpoint.lora_merge import adapters_from_checkpoint, adapters_from_peft
from checkpoint.names import CONTAINER_CONFIG
from checkpoint.outputs import HF_EXPORT, check_output
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.safetensors_writer import StreamingSafetensorsWriter
from checkpoint.staging import staged_directory
from checkpoint.writer import ConvertStats, copy_side_files
from common.progress import Progress


def _container(ckpt_dir: str) -> dict | None:
    path = os.path.join(ckpt_dir, CONTAINER_CONFIG)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def hub_layout(ckpt_dir: str):
    """key -> the key the export writes: a checkpoint converted from a multimodal container (it keeps the container's
    config.json beside, `CONTAINER_CONFIG`) is exported in the container's own layout (Qwen3.5's text keys under
    `model.language_model.`, Gemma 3's and Llama 4's under `language_model.`), its other towers carried back
    (checkpoint/carried.py); any other checkpoint as the text model it is."""
    from models.families import CONTAINERS

    conf = _container(ckpt_dir)
    return CONTAINERS[conf["model_type"]].hub_key if conf else (lambda key: key)


def write_container_config(out_dir: str) -> None:
    """An export of a container checkpoint: config.json is the container's again, its text model's part the
    checkpoint's config (a cast dtype included); the copy kept beside goes."""
    from models.families import CONTAINERS

    conf = _container(out_dir)
    if conf is None:
        return
    with open(os.path.join(out_dir, "config.json")) as f:
        text = json.load(f)
    container = CONTAINERS[conf["model_type"]]
    text.pop("architectures", None)
    conf[container.config_key] = {**(conf.get(container.config_key) or {}), **text}
    if "dtype" in text:
        conf["dtype"] = text["dtype"]
    if "quantization_config" not in text:  # dequantized at conversion (checkpoint/dequantize.py): plain weights now
        conf.pop("quantization_config", None)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    os.remove(os.path.join(out_dir, CONTAINER_CONFIG))


def parse_size(text: str) -> int:
    """A shard size as transformers' `save_pretrained(max_shard_size=...)` reads it: '5GB' (10**9 bytes),
    '2GiB' (2**30), '500MB', '200KB', '5Gb' (bits), or a plain byte count. Anything else: CheckpointError."""
    from transformers.utils.hub import convert_file_size_to_int

    try:
        size = convert_file_size_to_int(int(text) if text.strip().isdigit() else text.strip())
    except ValueError:
        size = 0
    if size <= 0:
        raise CheckpointError(
            f"--max-shard-size {text}: expected a whole number with a unit, as transformers takes it "
            "(5GB, 500MB, 2GiB, 200KB) or a byte count"
        )
    return size


@torch.inference_mode()
def export_pipeline_to_hf(
    ckpt_dir: str,
    out_dir: str,
    tag: str | None = None,
    dtype: str | None = None,
    max_shard_size: str = "5GB",
    force: bool = False,
    log=print,
    merge_lora: bool | str | None = None,
    recorded_input: str | None = None,
) -> ConvertStats:
    """Export `ckpt_dir/<tag>` (default: the tag in `latest`) as a Hugging Face model directory.

    `recorded_input`: what the output's `.convert2ckpt.json` names as the input (default `ckpt_dir`; the
    Hugging Face directory when `ckpt_dir` is a temporary conversion of it).

    `merge_lora=True` merges the adapters a LoRA run trained (its base comes from `lora.json`);
    a directory path merges that PEFT adapter, scaled per module as PEFT does (checkpoint/lora_merge.py).

    Raises:
        CheckpointError: bad input; nothing is left in `out_dir`.
    """
    start = time.perf_counter()
    adapter_dir = merge_lora if isinstance(merge_lora, str) else None
    check_output(out_dir, HF_EXPORT, force, [("input", ckpt_dir), ("adapter", adapter_dir)])
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    ckpt = PipelineCheckpoint(ckpt_dir, tag)
    weights, adapters = ckpt, None
    if merge_lora is True:
        weights, adapters = adapters_from_checkpoint(ckpt)
        check_output(out_dir, HF_EXPORT, force, [("LoRA base checkpoint", weights.ckpt_dir)])
    elif merge_lora:
        adapters = adapters_from_peft(merge_lora, ckpt.config)
    limit = parse_size(max_shard_size)
    # Plan every shard before reading any data: names, shapes and dtypes from memory-mapped layer files.
    hub = hub_layout(ckpt_dir)  # a multimodal source's own key names, else the text model's
    plan = [
        (hub(key), shape, DTYPES[dtype] if dtype and stored.is_floating_point else stored)
        for key, shape, stored in weights.plan_hf_tensors()
    ]
    plan += carried_plan(ckpt_dir)  # as the hub stored them, whatever --dtype says (checkpoint/carried.py)
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    shard_bytes = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * element_size(entry[2])
        if shards[-1] and shard_bytes + nbytes > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {key: name for name, shard in zip(names, shards) for key, _, _ in shard}
    total = sum(math.prod(shape) * element_size(dt) for _, shape, dt in plan)

    stats = ConvertStats()
    command = "--to-hf" + (" --merge-lora" if merge_lora else "")
    base = weights.ckpt_dir if merge_lora is True else None
    sources = [p for p in (recorded_input or ckpt_dir, base, adapter_dir) if p]
    with staged_directory(out_dir, force, HF_EXPORT, command, sorted(set(sources))) as tmp:
        model = ((hub(key), tensor) for key, tensor in weights.iter_hf_tensors(adapters))
        tensors = itertools.chain(model, iter_carried(ckpt_dir))
        progress = Progress("exporting", len(plan), unit="tensors")
        for name, shard in zip(names, shards):
            with StreamingSafetensorsWriter(os.path.join(tmp, name), shard, metadata={"format": "pt"}) as writer:
                for _, _, want in shard:
                    got_key, tensor = next(tensors)
                    writer.write(got_key, tensor.to(want) if tensor.dtype != want else tensor)
                    stats.tensors += 1
                    progress.update(1, tensor.numel() * want.itemsize)
            stats.files.append(name)
            stats.bytes_written += os.path.getsize(os.path.join(tmp, name))
        progress.close()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        copy_side_files(ckpt_dir, tmp, dtype, model_files_only=True)
        write_container_config(tmp)
    stats.seconds = time.perf_counter() - start
    log(
        f"exported {ckpt.step_dir} -> {out_dir}: {len(stats.files)} shards, {stats.tensors} tensors, "
        f"{stats.bytes_written / 2**20:.1f} MiB in {stats.seconds:.1f}s"
    )
    return stats
