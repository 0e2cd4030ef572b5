"""`lora.keep_quantized=true`: a LoRA run's frozen base held in the hub's own quantized format on each stage.

Conversion dequantizes FP8, MXFP4 and INT4 weights (checkpoint/dequantize.py), so a stage of DeepSeek-V3 would hold 2
bytes a weight of a base it never trains. With `keep_quantized`, the stage still loads its layers from the
conversion (norms, embeddings, routers, everything the hub keeps plain), then reads from the Hugging Face directory
the quantized tensors of its own decoder layers only (this EP rank's experts only; in file order, each weight held as
soon as its tensors have arrived, so host memory holds the weights under way, not the stage), and each linear layer and
fused experts tensor they belong to computes from them (models/frozen_weights.py: dequantized at each matmul,
models/hub_quantized.py: exactly as conversion dequantizes, bf16). Losses and gradients are therefore those of the
dequantized base, bit for bit, while the stage holds about one byte a weight (FP8, with one fp32 scale a block),
4.25 bits (MXFP4) or 4.5 (INT4 in groups of 32 with bf16 scales).

What it holds: every linear layer of a decoder layer whose weight has FP8 scales beside it on the hub; fused
experts stored fused in FP8 (one scale per expert or in blocks) or in MXFP4 (gpt-oss); experts stored one key per
expert in FP8 (DeepSeek-V3, Kimi K2) or INT4 (Kimi K2 Thinking, K2.5: compressed-tensors' pack-quantized), stacked
into transformers' fused [E, 2I, H] and [E, H, I] with their scales (gate rows then up rows: for FP8 the
intermediate size must be a whole number of blocks); linear layers stored in INT4. Everything else stays as loaded.
Under tensor parallelism each rank holds its shard of an FP8 weight by the weight's split rule and the scales of the
blocks in it (a shard must hold whole blocks, as 128-row blocks of real models' heads and widths do; a cut block is
refused in one line). Not built: MXFP4 and INT4 under tensor parallelism, refused in one line.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from checkpoint.dequantize import (
    INT4_PARTS,
    MXFP4_PARTS,
    fp8_blocks,
    int4_group,
    is_fp8,
    is_mxfp4,
    is_quantized,
    scale_key,
)
from checkpoint.expert_layouts import per_expert_sources
from checkpoint.hf_reader import is_hf_dir, iter_tensors, read_model_config, validate
from models.families import family_of, hf_classes
from models.frozen_weights import expert_weights, held_class, hold_experts, hold_linear
from models.hub_names import hub_key
from models.hub_quantized import FP8Weight, INT4Weight, MXFP4Weight, fp4_bytes, fp8_bytes, int4_bytes, mxfp4_bytes
from models.key_table import DECODER_PREFIX, moe_key
from models.layers import block_index
from models.moe import in_block, num_experts
from models.nf4 import nf4_experts
from models.pipe_layout import DECODER
from models.sharding import REPLICA, shard
from models.tp_rules import tp_split

PLAIN = torch.bfloat16  # what conversion dequantizes to, at load (training/hf_source.py) and by default


def keep_quantized_refusal(source: str | None, tp: int) -> str | None:
    """Why `lora.keep_quantized=true` cannot run from `source` (model_name_or_path) at tensor parallel size `tp`, or
    None."""
    if not source or not is_hf_dir(source):
        return (
            f"needs model_name_or_path to be the quantized Hugging Face directory or hub id (not {source}): the "
            "quantized tensors are read from it"
        )
    quant = read_model_config(source)
    if not is_quantized(quant):
        return f"{source} is not quantized (its config.json has no FP8, MXFP4 or INT4 quantization_config)"
    if tp > 1 and not is_fp8(quant):
        return f"tensor_parallel_size={tp}: only FP8 weights are split across TP ranks, not {quant_method(quant)}"
    return None


def quant_method(quant) -> str:
    return "MXFP4" if is_mxfp4(quant) else "INT4" if int4_group(quant) is not None else "FP8"


def _expert_keys(config, prefix: str, key: str, name: str, experts: range, present) -> list[list[str]]:
    """The hub's per-expert weight keys of fused expert tensor `name` (hub key `key`), [expert][part] (gate_up_proj:
    gate, up), of the experts `experts`; [[""]] where the hub keeps it fused."""
    if family_of(config).moe.hub_fused:  # fused on the hub, yet a checkpoint may store it one key per expert
        sources = per_expert_sources(key, config, present)
        if not sources:
            return [[""]]
        per = len(sources) // num_experts(config)
        return [sources[e * per : (e + 1) * per] for e in experts]
    parts = ("gate", "up") if name == "gate_up_proj" else ("down",)
    return [[hub_key(config, prefix + moe_key(config, part, e)) for part in parts] for e in experts]


def _plan(module: nn.Module, config, quant, present, experts: range | None) -> list[tuple]:
    """(target module, parameter name or None for a linear layer, kind, hub keys, our key: its tensor-parallel rule's)
    of every weight to hold (`quant`: the hub's config, which says how it is quantized)."""
    fp8, mxfp4, int4 = is_fp8(quant), is_mxfp4(quant), int4_group(quant) is not None
    plan = []
    for layer in [m for m in module.modules() if isinstance(m, hf_classes("DecoderLayer"))]:
        prefix = DECODER_PREFIX.format(block_index(layer))
        for name, linear in layer.named_modules():
            if isinstance(linear, nn.Linear) and held_class(type(linear)) and isinstance(linear.weight, torch.Tensor):
                key = hub_key(config, f"{prefix}{name}.weight")
                if fp8 and scale_key(key) in present:
                    plan.append((linear, None, "fp8", [key, scale_key(key)], f"{name}.weight"))
                elif int4 and _int4_parts(key)[0] in present:
                    plan.append((linear, None, "int4", _int4_parts(key), f"{name}.weight"))
        sparse = nf4_experts(layer)
        if sparse is None:
            continue
        block, fused = sparse
        mine = experts if experts is not None else range(len(getattr(fused, expert_weights(fused)[0])))
        for name in expert_weights(fused):
            ours = in_block(family_of(config).moe.block, f"experts.{name}")
            key = hub_key(config, prefix + ours)
            per = _expert_keys(config, prefix, key, name, mine, present)
            if mxfp4 and key + MXFP4_PARTS[0] in present:
                plan.append(((fused, block), name, ("mxfp4", mine), [key + part for part in MXFP4_PARTS], ours))
            elif fp8 and scale_key(key) in present:
                plan.append(((fused, block), name, ("fused fp8", mine), [key, scale_key(key)], ours))
            elif fp8 and scale_key(per[0][0]) in present:
                keys = [k for pieces in per for w in pieces for k in (w, scale_key(w))]
                plan.append(((fused, block), name, ("expert fp8", len(per[0])), keys, ours))
            elif int4 and _int4_parts(per[0][0])[0] in present:
                keys = [k for pieces in per for w in pieces for k in _int4_parts(w)]
                plan.append(((fused, block), name, ("expert int4", len(per[0])), keys, ours))
    return plan


def _int4_parts(weight_key: str) -> list[str]:
    """The packed values and the scales of an INT4 weight (`weight_shape` beside them: the model's shape says it)."""
    return [weight_key.removesuffix("weight") + part for part in INT4_PARTS[:2]]


def _held(kind, tensors: list[torch.Tensor], quant, shape: tuple[int, ...], split: tuple) -> nn.Module:
    """The held weight of one plan entry from its hub tensors; `shape`: the dense weight's (this TP rank's);
    `split`: (TP rule, rank, size), FP8 only."""
    blocks = fp8_blocks(quant)

    def fp8(weight: torch.Tensor, scale: torch.Tensor) -> FP8Weight:
        return FP8Weight(*_shard_fp8(weight, scale, blocks, *split), blocks, PLAIN)

    if split[2] > 1 and "fp8" not in (kind if isinstance(kind, str) else kind[0]):
        raise ValueError("only FP8 weights are split across tensor-parallel ranks")
    if kind == "fp8":
        return fp8(*tensors)
    if kind == "int4":
        return INT4Weight(*tensors, shape[-1], int4_group(quant), PLAIN)
    kind, arg = kind
    if kind == "mxfp4":  # (this rank's experts copied out: a view would keep every expert's bytes)
        return MXFP4Weight(*(t[arg.start : arg.stop].clone() for t in tensors), PLAIN)
    if kind == "fused fp8":
        weight, scale = tensors
        per_expert = scale.dim() >= 1 and scale.shape[0] == weight.shape[0]  # ([E, ...]: else one for all)
        scale = scale[arg.start : arg.stop].clone() if per_expert else scale
        return fp8(weight[arg.start : arg.stop].clone(), scale)
    weights, scales = tensors[0::2], tensors[1::2]  # per expert, `arg` parts each (gate, up: rows stacked)

    def stacked(parts: list[torch.Tensor]) -> torch.Tensor:  # [E, rows of its parts, ...]
        return torch.stack([torch.cat(parts[i : i + arg]) for i in range(0, len(parts), arg)])

    if kind == "expert int4":  # (rows are independent: no block to straddle)
        return INT4Weight(stacked(weights), stacked(scales), shape[-1], int4_group(quant), PLAIN)
    fp4 = weights[0].dtype == torch.int8  # (DeepSeek-V4's FP4: a scale a row, rows stack freely)
    if arg > 1 and not fp4 and (blocks is None or weights[0].shape[0] % blocks[0]):
        raise ValueError(f"experts of {weights[0].shape[0]} rows are not a whole number of {blocks} FP8 blocks")
    return fp8(stacked(weights), stacked(scales))


def _shard_fp8(weight, scale, block, rule: str, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This tensor-parallel rank's shard of an FP8 weight [..., rows, cols] by `rule` (models/sharding.py) and the
    scales of the blocks it holds; ValueError where a shard boundary cuts a block (the grid's blocks, `block` None:
    per tensor, any cut keeps its one scale)."""
    if size == 1 or rule == REPLICA:
        return weight, scale
    out = shard(weight.view(torch.uint8), rule, rank, size).view(weight.dtype)
    for d in range(weight.dim() - 2, weight.dim()):
        n, grid = weight.shape[d], scale.shape[d] if scale.dim() == weight.dim() else 1
        if out.shape[d] == n or grid == 1:
            continue
        fp4 = weight.dtype == torch.int8  # DeepSeek-V4's FP4: blocks by the scale's grid, over packed bytes
        b = n // grid if fp4 or not block else block[d - weight.dim() + 2]
        index = [1] * weight.dim()
        index[d] = n
        blocks = torch.arange(n) // b
        got = shard(blocks.view(index), rule, rank, size).flatten()  # the block of each row (column) it holds
        held = got.unique()  # (sorted)
        whole = torch.bincount(got, minlength=grid)[held] == torch.bincount(blocks)[held]
        if not (whole.all() and torch.equal(got, got.sort().values)):
            raise ValueError(f"tensor parallel size {size} cuts its {b}-wide FP8 blocks (dimension {d} of {n})")
        scale = scale.index_select(d, held)
    return out, scale.contiguous()


def _fp4_experts(quant) -> bool:
    """Whether the hub keeps its routed experts in FP4 (DeepSeek-V4's `expert_dtype: fp4`)."""
    config = getattr(quant, "quantization_config", None) or {}
    return (config if isinstance(config, dict) else config.to_dict()).get("expert_dtype") == "fp4"


def planned_bytes(layer: nn.Module, config, quant, present, experts: range | None = None) -> tuple[int, int, int]:
    """What `hold_hub_weights` would hold of one decoder layer (built on the meta device) from a hub of `quant`'s
    quantization whose keys are `present`, `experts` the rank's experts (default all): (the dense weights it holds,
    the bytes they take held, the dense expert weights a forward dequantizes)."""
    numel = held = local = 0
    for target, name, kind, *_ in _plan(layer, config, quant, present, experts):
        shape = tuple(target.weight.shape if name is None else getattr(target[0], name).shape)
        if name is not None and experts is not None:
            shape = (len(experts), *shape[1:])
        kind, n, rows, cols = kind if isinstance(kind, str) else kind[0], math.prod(shape), *shape[-2:]
        if "fp8" in kind and name is not None and _fp4_experts(quant):
            held += n // (rows * cols) * fp4_bytes(rows, cols)
        elif "fp8" in kind:
            held += n // (rows * cols) * fp8_bytes(rows, cols, fp8_blocks(quant))
        elif "int4" in kind:
            held += n // (rows * cols) * int4_bytes(rows, cols, int4_group(quant))
        else:
            held += mxfp4_bytes(n)
        numel, local = numel + n, local + (n if name is not None else 0)
    return numel, held, local


def hold_hub_weights(
    module: nn.Module, hf_dir: str, config, experts: range | None = None, tp: tuple[int, int] = (0, 1)
) -> int:
    """Hold the decoder layers of `module` (a pipeline stage, or a whole transformers model of `config`, which
    need not say it is quantized) in the quantized format of `hf_dir`, reading only their tensors (`experts`: the
    experts this rank holds; default all; `tp`: this rank's (rank, size) of tensor parallelism, whose shards of FP8
    weights and scales it takes by the split rules). Returns how many weights it holds. ValueError, one line, for
    tensors that do not fit the model or a shard that cuts a block."""
    present, quant = validate(hf_dir), read_model_config(hf_dir)
    plan = _plan(module, config, quant, present, experts)
    missing = [k for *_, keys, _ in plan for k in keys if k not in present]
    if missing:
        raise ValueError(f"{hf_dir}: {missing[0]} is missing (its checkpoint holds the others of its layer)")
    entry_of = {k: i for i, (*_, keys, _) in enumerate(plan) for k in keys}
    arrived: dict[int, dict[str, torch.Tensor]] = {}  # an entry's tensors, until they have all arrived
    experts_held = {}  # {experts module: (its sparse block, {parameter: held weight})}
    for key, tensor, _ in iter_tensors(hf_dir, set(entry_of)):  # each weight held as it is complete: host memory
        i = entry_of[key]  # holds the entries under way, not the stage
        arrived.setdefault(i, {})[key] = tensor
        target, name, kind, keys, ours = plan[i]
        if len(arrived[i]) < len(keys):
            continue
        tensors = arrived.pop(i)
        try:
            shape = target.weight.shape if name is None else getattr(target[0], name).shape
            split = (tp_split(DECODER, ours, config), *tp)
            held = _held(kind, [tensors.pop(k) for k in keys], quant, tuple(shape), split)
        except ValueError as e:
            raise ValueError(f"{hf_dir}: {keys[0]}: {e}") from None
        if name is None:
            hold_linear(target, held.to(target.weight.device))
        else:
            fused, block = target
            experts_held.setdefault(fused, (block, {}))[1][name] = held.to(getattr(fused, name).device)
    for fused, (block, held) in experts_held.items():
        hold_experts(fused, held, block)
    return len(plan)
