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

import json
import math
import os
import shutil
import time

import torch

from checkpoint.convert import DTYPES, ConvertStats, load_llama_config, prepare_output, publish, record_dtype
from checkpoint.hf_reader import CheckpointError
from checkpoint.lora_merge import adapters_from_checkpoint, adapters_from_peft
from checkpoint.pipeline_reader import iter_hf_tensors, plan_hf_tensors, read_tag
from checkpoint.safetensors_writer import StreamingSafetensorsWriter

# Files that make a directory loadable with AutoModelForCausalLM / AutoTokenizer (weights aside).
HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
)


def parse_size(text: str) -> int:
    """'5GB', '500MB', '200KB' or a byte count -> bytes."""
    units = {"GB": 2**30, "MB": 2**20, "KB": 2**10}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def _write_side_files(ckpt_dir: str, out_dir: str, dtype: str | None) -> None:
    for name in HF_SIDE_FILES:
        src = os.path.join(ckpt_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))
    if dtype:
        record_dtype(os.path.join(out_dir, "config.json"), dtype)


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
) -> ConvertStats:
    """Export `ckpt_dir/<tag>` (default: the tag in `latest`) as a Hugging Face model directory.

    `merge_lora=True` merges the adapters a LoRA run trained (its base comes from `lora.json`);
    a directory path merges that PEFT adapter; either way W + (alpha / r) * B @ A.

    Raises:
        CheckpointError: bad input; nothing is left in `out_dir`.
    """
    start = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    config = load_llama_config(ckpt_dir)
    tag = read_tag(ckpt_dir, tag)
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        raise CheckpointError(f"{os.path.join(ckpt_dir, tag)}: no such checkpoint")
    weights_dir, weights_tag, adapters, scale = ckpt_dir, tag, None, 1.0
    if merge_lora is True:
        weights_dir, adapters, scale = adapters_from_checkpoint(ckpt_dir, tag, config)
        weights_tag = read_tag(weights_dir)
    elif merge_lora:
        adapters, scale = adapters_from_peft(merge_lora, config)
    limit = parse_size(max_shard_size)
    # Plan every shard before reading any data: names, shapes and dtypes from memory-mapped layer files.
    plan = [
        (key, shape, DTYPES[dtype] if dtype and stored.is_floating_point else stored)
        for key, shape, stored in plan_hf_tensors(weights_dir, config, weights_tag)
    ]
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
    shard_bytes = 0
    for entry in plan:
        nbytes = math.prod(entry[1]) * torch.empty((), dtype=entry[2]).element_size()
        if shards[-1] and shard_bytes + nbytes > limit:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(entry)
        shard_bytes += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {key: name for name, shard in zip(names, shards) for key, _, _ in shard}
    total = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for _, shape, dt in plan)

    tmp = prepare_output(out_dir, force)
    stats = ConvertStats()
    try:
        tensors = iter_hf_tensors(weights_dir, config, weights_tag, adapters, scale)
        for name, shard in zip(names, shards):
            with StreamingSafetensorsWriter(os.path.join(tmp, name), shard, metadata={"format": "pt"}) as writer:
                for _, _, want in shard:
                    got_key, tensor = next(tensors)
                    writer.write(got_key, tensor.to(want) if tensor.dtype != want else tensor)
                    stats.tensors += 1
            stats.files.append(name)
            stats.bytes_written += os.path.getsize(os.path.join(tmp, name))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
        _write_side_files(ckpt_dir, tmp, dtype)
        publish(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stats.seconds = time.perf_counter() - start
    log(
        f"exported {os.path.join(ckpt_dir, tag)} -> {out_dir}: {len(stats.files)} shards, {stats.tensors} tensors, "
        f"{stats.bytes_written / 2**20:.1f} MiB in {stats.seconds:.1f}s"
    )
    return stats
