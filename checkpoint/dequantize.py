"""FP8 hub weights dequantized at conversion, the way transformers dequantizes them.

DeepSeek-V3's (and Kimi K2's) official checkpoints store their linear layers' weights as float8 (e4m3) in blocks
(`quantization_config`: `quant_method: fp8`, `weight_block_size: [128, 128]`), each block's scale beside the weight
as `<module>.weight_scale_inv` [ceil(rows / 128), ceil(cols / 128)] (fp32). Training needs real weights, so
conversion multiplies each block by its scale in fp32 and casts the product to the conversion's dtype (bf16 unless
`--dtype` says otherwise): transformers' `Fp8Dequantize` (`integrations/finegrained_fp8.py`) computes the same
products where the blocks divide the weight (tests/test_convert.py holds the two equal); where they do not, the
scale grid is the ceiling of the blocks, and the edge blocks are cut to the weight. The converted config.json keeps
no `quantization_config`: the checkpoint is a plain bf16 model, and so is its export.
"""

from __future__ import annotations

import torch

from checkpoint.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"  # `<module>.weight_scale_inv` beside `<module>.weight`


def fp8_blocks(config) -> tuple[int, int] | None:
    """The (rows, cols) of a block of an FP8 block-quantized checkpoint, or None for a plain one."""
    quant = getattr(config, "quantization_config", None)
    if not quant:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method != "fp8" or not block or len(block) != 2:
        raise CheckpointError(
            f"quantization_config {method!r} (weight_block_size={block}): only FP8 block "
            "quantization is dequantized at conversion; convert a bf16 copy of the model"
        )
    return int(block[0]), int(block[1])


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def is_scale(hf_key: str, config) -> bool:
    """Whether `hf_key` is a block scale of an FP8 checkpoint's weight (consumed by `dequantize`)."""
    return hf_key.endswith(".weight" + SCALE_SUFFIX) and fp8_blocks(config) is not None


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [rows, cols] times its block scales [ceil(rows / b0), ceil(cols / b1)], in fp32, as `dtype`."""
    rows, cols = weight.shape[-2:]
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not tile a {tuple(weight.shape)} weight in {block} blocks"
        )
    grid = scale.to(torch.float32).repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return (weight.to(torch.float32) * grid[..., :rows, :cols]).to(dtype)
