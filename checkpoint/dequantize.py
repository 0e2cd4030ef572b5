"""Quantized hub weights dequantized at conversion, the way transformers dequantizes them: FP8 blocks, MXFP4 experts.

DeepSeek-V3's (and Kimi K2's) official checkpoints store their linear layers' weights as float8 (e4m3) in blocks
(`quantization_config`: `quant_method: fp8`, `weight_block_size: [128, 128]`), each block's scale beside the weight
as `<module>.weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)] (fp32). Training needs real weights, so
conversion multiplies each block by its scale in fp32 and casts the product to the conversion's dtype (bf16 unless
`--dtype` says otherwise): transformers' `Fp8Dequantize` (`integrations/finegrained_fp8.py`) computes the same
products where the blocks divide the weight (tests/test_convert.py holds the two equal); where they do not, the
scale grid is the ceiling of the blocks, and the edge blocks are cut to the weight. The converted config.json keeps
no `quantization_config`: the checkpoint is a plain bf16 model, and so is its export.

Mistral's FP8 checkpoints (Mistral Small 4, Ministral 3: `weight_block_size: null`) keep one scale per tensor
(`weight_scale_inv`, a scalar) and, fused experts, one per expert (`gate_up_proj_scale_inv`, `down_proj_scale_inv`
[E, 1, 1]), with static activation scales (`activation_scale`, `*_activation_scale`) that training has no use for
(dropped). The blocks are then whatever the scale's grid cuts the weight into, as transformers' `Fp8Dequantize` reads
them.

gpt-oss's official checkpoints keep their experts in MXFP4 (`quant_method: mxfp4`): each expert tensor `X` is
stored as `X_blocks` (two 4-bit e2m1 values per byte, 32 values per block) and `X_scales` (one power-of-two exponent
per block); transformers' own pure-torch routine (`integrations/mxfp4.py` `convert_moe_packed_tensors`) turns the
pair into `X` in transformers' x @ W layout, and conversion calls it as each expert tensor arrives.

DeepSeek-V4's official checkpoints (V4-Flash) keep FP8 blocks with power-of-two scales (`scale_fmt: ue8m0`: one
byte, float8_e8m0fnu) under DeepSeek's `<module>.scale`, which transformers' FP8 loader reads as `weight_scale_inv`
(so does conversion: checkpoint/hf_reader.py `FP8_SCALE_ALIAS`), and their routed experts in FP4 (`expert_dtype:
fp4`): each expert's weight int8 [rows, cols / 2], two e2m1 values a byte (the low nibble first), one scale per row
and 32 columns. Every int8 weight of an FP8 checkpoint is such an FP4 one, unpacked and scaled by its grid's blocks,
as transformers' `Fp8Dequantize` does.

Kimi K2 Thinking's and Kimi K2.5's official checkpoints keep their routed experts in INT4 (`quant_method:
compressed-tensors`, `format: pack-quantized`, weights symmetric, 4 bits, in groups of 32 along the input): each
`<module>.weight` is stored as `weight_packed` (int32, eight values per word, the lowest nibble first, each value
offset by 8), `weight_scale` (one per group, bf16) and `weight_shape`; the modules the config's `ignore` names stay
plain. The weight is the values times their group's scale, computed in the scale's dtype, as compressed-tensors'
`PackedQuantizationCompressor.decompress` (what transformers loads such a checkpoint with) computes it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from checkpoint.errors import CheckpointError
from checkpoint.expert_layouts import Assembly, has_expert_parts, is_expert_part, per_expert_sources
from checkpoint.hf_reader import iter_tensors, validate
from models.hub_quantized import dequantize, int4_to_plain, mxfp4_to_plain

SCALE_SUFFIX = "_scale_inv"  # `<module>.weight_scale_inv` beside `<module>.weight`


MXFP4_PARTS = ("_blocks", "_scales")  # `X_blocks`, `X_scales` in place of `X`
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")  # in place of `<module>.weight`


def _quantization(config) -> dict:
    quant = getattr(config, "quantization_config", None) or {}
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method == "compressed-tensors":
        _int4_weights(quant)
        if has_expert_parts(config):
            raise CheckpointError(
                f"quantization_config compressed-tensors on {config.model_type}, whose experts are fused on the hub: "
                "only experts stored one key per expert (Kimi K2's) are dequantized; convert a bf16 copy of the model"
            )
    elif quant and not (method == "mxfp4" or (method == "fp8" and (block is None or len(block) == 2))):
        raise CheckpointError(
            f"quantization_config {method!r} (weight_block_size={block}): only FP8 (in blocks or per tensor), "
            "MXFP4 and compressed-tensors' INT4 are dequantized at conversion; convert a bf16 copy of the model"
        )
    return quant


def _int4_weights(quant: dict) -> dict:
    """The weight arguments of a compressed-tensors config that conversion dequantizes: pack-quantized, symmetric
    4-bit integers by group or channel, weights only, one scheme for every group; CheckpointError, one line, else."""
    groups = list((quant.get("config_groups") or {}).values())
    schemes = [g.get("weights") or {} for g in groups]
    args = schemes[0] if schemes else {}
    fields = ("num_bits", "type", "symmetric", "strategy")
    extras = ("kv_cache_scheme", "sparsity_config", "transform_config")
    supported = (
        quant.get("format") == "pack-quantized"
        and not any(quant.get(k) for k in extras)
        and args.get("actorder") is None  # else the columns may be permuted (`weight_g_idx`)
        and all(s == args for s in schemes)
        and not any(g.get("input_activations") for g in groups)
        and tuple(args.get(f) for f in fields) in {(4, "int", True, "group"), (4, "int", True, "channel")}
    )
    if not supported:
        raise CheckpointError(
            f"quantization_config compressed-tensors (format {quant.get('format')!r}, weights "
            f"{ {f: args.get(f) for f in (*fields, 'actorder')} }, "
            f"{ {k: bool(quant.get(k)) for k in extras} }): only symmetric INT4 weights, pack-quantized by group or "
            "channel (Kimi K2 Thinking's and K2.5's), are dequantized at conversion; convert a bf16 copy of the model"
        )
    return args


def is_quantized(config) -> bool:
    """Whether conversion dequantizes the checkpoint's weights (to bf16 unless `--dtype` says otherwise)."""
    return bool(_quantization(config))


def is_fp8(config) -> bool:
    """Whether the checkpoint's weights are FP8 with their scales beside (in blocks or per tensor)."""
    return _quantization(config).get("quant_method") == "fp8"


def fp8_blocks(config) -> tuple[int, int] | None:
    """The (rows, cols) of a block of an FP8 block-quantized checkpoint, or None for any other (per-tensor FP8: the
    scale's grid says)."""
    block = _quantization(config).get("weight_block_size") if is_fp8(config) else None
    return (int(block[0]), int(block[1])) if block else None


def is_mxfp4(config) -> bool:
    return _quantization(config).get("quant_method") == "mxfp4"


def int4_group(config) -> int | None:
    """The group size of an INT4 (compressed-tensors) checkpoint's weights: 0 per channel (one scale a row); None
    for any other checkpoint."""
    quant = _quantization(config)
    if quant.get("quant_method") != "compressed-tensors":
        return None
    args = _int4_weights(quant)
    return int(args["group_size"]) if args["strategy"] == "group" else 0


def hub_sources(hf_key: str, config, present) -> list[str]:
    """The hub tensors that hold model tensor `hf_key` (`present`: the checkpoint's keys): itself, its MXFP4
    blocks and scales, or its experts' keys (checkpoint/expert_layouts.py)."""
    if hf_key not in present and is_mxfp4(config) and hf_key + MXFP4_PARTS[0] in present:
        return [hf_key + part for part in MXFP4_PARTS]
    stem = hf_key.removesuffix("weight")
    if hf_key not in present and stem + INT4_PARTS[0] in present and int4_group(config) is not None:
        return [stem + part for part in INT4_PARTS]
    return per_expert_sources(hf_key, config, present) or [hf_key]


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def is_scale(hf_key: str, config) -> bool:
    """Whether `hf_key` is no model tensor as it stands but a piece of one: a scale of an FP8 checkpoint's weight
    (consumed by `dequantize`; static activation scales, dropped), a part of an MXFP4 tensor (`mxfp4_to_plain`) or
    one expert's piece of a fused tensor (checkpoint/expert_layouts.py `Assembly`)."""
    if is_expert_part(hf_key, config):
        return True
    if is_mxfp4(config):
        return hf_key.endswith(MXFP4_PARTS)
    if int4_group(config) is not None:
        return hf_key.endswith(INT4_PARTS)
    return is_fp8(config) and hf_key.endswith((SCALE_SUFFIX, "activation_scale"))  # activation scales: dropped


def _fp8_scales(hf_dir: str, weights: set[str], present) -> dict[str, torch.Tensor]:
    """{weight key: its block scales} of the FP8 weights among `weights` (scales are 1/16384 of their weights;
    `present`: the checkpoint's keys)."""
    scales = {scale_key(w): w for w in weights}
    wanted = set(scales) & set(present)
    return {scales[name]: scale.clone() for name, scale, _ in iter_tensors(hf_dir, wanted)}


def plain_tensors(
    hf_dir: str, config, wanted: set[str], dtype: torch.dtype, pool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(model key, tensor) of every key in `wanted`, read from `hf_dir` in shard order, quantized ones dequantized to
    `dtype` as they arrive (`pool`: the conversion's BufferPool, which the reads take buffers from)."""
    if not is_quantized(config) and not has_expert_parts(config):
        for name, tensor, _ in iter_tensors(hf_dir, wanted, alloc=pool.take):
            yield name, tensor
        return
    present = validate(hf_dir)
    from_parts = {key: srcs for key in wanted if (srcs := hub_sources(key, config, present)) != [key]}
    sources = {src: key for key in wanted for src in from_parts.get(key, [key])}
    blocks = fp8_blocks(config)
    scales = _fp8_scales(hf_dir, set(sources), present) if is_fp8(config) else {}
    parts: dict[str, dict[str, torch.Tensor]] = {}  # a tensor's MXFP4 or INT4 parts, until they have all arrived
    packed = is_mxfp4(config) or int4_group(config) is not None
    fused = {key: Assembly(srcs, config) for key, srcs in from_parts.items()} if not packed else {}
    for name, tensor, _ in iter_tensors(hf_dir, set(sources), alloc=pool.take):
        key = sources[name]
        if name in scales:  # an FP8 weight, or one expert's piece of a fused one
            piece = dequantize(tensor, scales.pop(name), blocks, dtype)
            pool.give(tensor)
        elif (
            tensor.dtype.itemsize == 1
            and (tensor.dtype.is_floating_point or tensor.dtype == torch.int8)
            and is_fp8(config)
        ):
            kind = "FP4" if tensor.dtype == torch.int8 else "FP8"
            raise CheckpointError(f"{hf_dir}: {name} is {kind} without its scale ({scale_key(name)})")
        else:
            piece = tensor
        if key == name:
            yield key, piece
        elif key in fused:
            whole = fused[key].add(name, piece)
            pool.give(piece)  # copied into the fused tensor
            if whole is not None:
                del fused[key]
                yield key, whole
        else:
            parts.setdefault(key, {})[name] = piece
            if len(parts[key]) == len(from_parts[key]):
                held = [parts[key][src] for src in from_parts[key]]
                del parts[key]
                if is_mxfp4(config):
                    plain = mxfp4_to_plain(*held, dtype)
                else:
                    try:
                        plain = int4_to_plain(*held, int4_group(config), dtype)
                    except ValueError as e:
                        raise CheckpointError(f"{hf_dir}: {key}: {e}") from None
                for t in held:
                    pool.give(t)
                yield key, plain
