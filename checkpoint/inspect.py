"""`convert2ckpt.py --inspect CKPT_DIR`: what a pipeline checkpoint holds, read from metadata only.

Reports the model shape, the layer files and their dtype, the tensor-parallel ranks, the layout
(stages, partition, DP size) that saved it, the optimizer state's DP sharding, the step and the
size on disk. Tensor data is never read: layer files are opened memory-mapped.
"""

from __future__ import annotations

import json
import os
from collections import Counter

from checkpoint.layer_files import layer_tensor_specs
from checkpoint.names import ZERO_FILE, engine_file, parse_layer_file_name
from checkpoint.pipeline_reader import PipelineCheckpoint
from checkpoint.safe_load import load_pt
from checkpoint.universal import read_layout
from models.layer_config import global_attr, layer_attr
from models.moe import experts_per_token


def experts_of(config) -> dict:
    """A model with experts: how many, routed per token, and in how many decoder layers (else nothing)."""
    from models.families import family_of
    from models.layer_kinds import is_sparse_layer

    moe = family_of(config).moe
    if moe is None:
        return {}
    sparse = sum(is_sparse_layer(config, b) for b in range(config.num_hidden_layers))
    experts = getattr(config, moe.num_experts)
    return {"experts": experts, "experts_per_token": experts_per_token(config), "sparse_layers": sparse}


def describe(ckpt_dir: str, tag: str | None = None) -> dict:
    """Everything `--inspect` prints, as a dict."""
    ckpt = PipelineCheckpoint(ckpt_dir, tag)  # its engine files' pickles scanned: none is unsafe
    config, step_dir, names = ckpt.config, ckpt.step_dir, ckpt.names
    layers = config.num_hidden_layers
    layer_files = {n: parsed for n in names if (parsed := parse_layer_file_name(n))}
    zero_files = [m for n in names if (m := ZERO_FILE.fullmatch(n))]
    tp_ranks = sorted({tp for _, tp, _ in layer_files.values()}) or [0]
    held = {(index, tp) for index, tp, _ in layer_files.values()}
    missing = sorted(
        {layer.index for layer in ckpt.layers for tp in range(max(tp_ranks) + 1) if (layer.index, tp) not in held}
    )
    dtypes: Counter = Counter()
    for i, name in enumerate(layer_files):  # every file is opened (memory-mapped: metadata only): none is unsafe
        specs = layer_tensor_specs(os.path.join(step_dir, name))
        if i < 3:  # the dtype from a few files is enough
            dtypes.update(str(dtype).removeprefix("torch.") for _, dtype in specs.values())
    engine = {}
    if engine_file(0) in names:
        engine = load_pt(os.path.join(step_dir, engine_file(0)), mmap=True)
    layout = read_layout(step_dir)
    sizes = {n: os.path.getsize(os.path.join(step_dir, n)) for n in names if os.path.isfile(os.path.join(step_dir, n))}
    optimizer = "none"
    if zero_files:
        dp = len({m.group(2) for m in zero_files})
        optimizer = f"ZeRO-1 shards over DP={dp} ({'bf16' if zero_files[0].group(1) else 'fp32/fp16'} optimizer)"
    elif engine.get("optimizer"):
        optimizer = f"whole per stage (ZeRO-0), saved with DP={engine.get('dp_world_size')}"
    return {
        "checkpoint": step_dir,
        "source": "converted from Hugging Face" if engine.get("converted_from_hf") else "saved by the trainer",
        "step": engine.get("global_steps", 0),
        "model": {
            "num_hidden_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads,
            # as config.json states it; each layer's where layers differ (Gemma 4's global layers)
            "num_key_value_heads": global_attr(config, "num_key_value_heads"),
            "kv_heads_by_layer": sorted({layer_attr(config, b, "num_key_value_heads") for b in range(layers)}),
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": config.tie_word_embeddings,
            **experts_of(config),
        },
        "layer_files": len(layer_files),
        "format": sorted({fmt for _, _, fmt in layer_files.values()}),
        "missing_layers": missing,  # layer indices without a file for some tensor-parallel rank
        "tp_ranks": tp_ranks,
        "dtype": dict(dtypes),
        "layout": layout
        or {"num_stages": None, "note": "no layout.json: a converted checkpoint, loadable with any number of stages"},
        "optimizer_state": optimizer,
        "bytes": {
            "layer_files": sum(sizes[n] for n in layer_files),
            "optimizer_and_engine": sum(v for n, v in sizes.items() if n not in layer_files),
            "total": sum(sizes.values()),
        },
    }


def format_description(info: dict) -> str:
    m, layout, size = info["model"], info["layout"], info["bytes"]
    lines = [
        f"checkpoint   {info['checkpoint']} ({info['source']}, step {info['step']})",
        f"model        {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, heads {m['num_attention_heads']} "
        f"(KV {'/'.join(str(n) for n in m['kv_heads_by_layer'])}), vocab {m['vocab_size']}, "
        f"tied embeddings {m['tie_word_embeddings']}"
        + (
            f", {m['experts']} experts (top-{m['experts_per_token']}) in {m['sparse_layers']} layers"
            if "experts" in m
            else ""
        ),
        f"layer files  {info['layer_files']} {'/'.join(info['format'])} ({', '.join(info['dtype'])}); "
        f"TP ranks {info['tp_ranks']}; missing layers {info['missing_layers'] or 'none'}",
    ]
    if layout.get("num_stages"):
        bounds = layout["stage_bounds"]
        held = layout.get("rank_layers") or [range(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        lines.append(
            f"saved with   PP={layout['num_stages']} x TP={layout.get('tp_size', 1)} x DP={layout['dp_size']}"
            f"{' (sequence parallel)' if layout.get('sequence_parallel') else ''}, "
            f"{layout.get('pipeline_schedule', '1f1b')} schedule, pipeline ranks hold layers "
            f"{[_spans(layers) for layers in held]}, "
            f"{layout['precision']}, ZeRO-{layout['zero_stage']}, global batch {layout['global_batch_size']}"
        )
    else:
        lines.append(f"saved with   {layout['note']}")
    lines.append(f"optimizer    {info['optimizer_state']}")
    lines.append(
        f"size         {size['total'] / 2**20:.1f} MiB (layers {size['layer_files'] / 2**20:.1f} MiB, "
        f"optimizer/engine {size['optimizer_and_engine'] / 2**20:.1f} MiB)"
    )
    return "\n".join(lines)


def _spans(layers) -> str:
    """[0, 1, 2, 7, 8] -> "0-2+7-8": the runs of consecutive pipeline layers a rank holds."""
    layers, runs = sorted(layers), []
    for i in layers:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return "+".join(f"{a}-{b}" for a, b in runs)


def inspect_checkpoint(ckpt_dir: str, tag: str | None = None, as_json: bool = False) -> str:
    info = describe(ckpt_dir, tag)
    return json.dumps(info, indent=2) if as_json else format_description(info)
