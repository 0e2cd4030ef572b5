"""The hub's quantized formats as model weights: FP8 blocks (DeepSeek-V3, Kimi K2; per tensor: Mistral's) and MXFP4
experts (gpt-oss), dequantized exactly as conversion dequantizes them (checkpoint/dequantize.py, which reads them
from the hub and says how transformers reads each), and held as such by a LoRA run with `lora.keep_quantized=true`
(models/frozen_weights.py: dequantized at each matmul).

A held hub weight dequantizes to the dtype conversion would have written (`plain_dtype`: bf16), then to the
product's dtype: the run computes with exactly the weights of the dequantized checkpoint, bit for bit, while it
holds about a byte a weight (FP8, with one fp32 scale a block) or 4.25 bits (MXFP4).

Model code only: no distributed code, no file reading.
"""

from __future__ import annotations

import sys

import torch

from models.frozen_weights import HeldWeight, as_bytes

# The e2m1 values of an FP4 nibble (sign bit high), as transformers' `Fp8Dequantize` reads them.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """An FP8 weight [..., rows, cols] times its block scales [..., ceil(rows / b0), ceil(cols / b1)], in fp32, as
    `dtype`. `block` None (per-tensor FP8): the blocks the scale's grid cuts each matrix into (one scale: one
    block). Fused experts [E, rows, cols] a matrix at a time, so that they never stand whole in fp32."""
    if weight.dim() > 2:
        matrices = weight.view(-1, *weight.shape[-2:])
        grid = scale.shape[-2:] if scale.numel() > len(matrices) else (1, 1)
        cols = weight.shape[-1] * (2 if weight.dtype == torch.int8 else 1)  # FP4: two values a byte
        out = torch.empty(*weight.shape[:-1], cols, dtype=dtype, device=weight.device)
        pieces = out.view(len(matrices), matrices.shape[-2], cols)
        for piece, w, s in zip(pieces, matrices, scale.reshape(len(matrices), *grid), strict=True):
            piece.copy_(dequantize(w, s, block, dtype))
        return out
    if weight.dtype == torch.int8:  # FP4, two e2m1 values a byte (DeepSeek-V4's experts): blocks by the scale's grid
        weight, block = unpack_fp4(weight), None
    if scale.dtype == torch.uint8:  # power-of-two exponents (+ 127), as transformers reads one-byte scales
        scale = torch.exp2(scale.to(torch.float32) - 127.0)
    rows, cols = weight.shape
    scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
    if block is None:
        if scale.dim() != 2 or rows % scale.shape[0] or cols % scale.shape[1]:
            raise ValueError(f"scale shape {tuple(scale.shape)} does not divide a {tuple(weight.shape)} weight")
        block = (rows // scale.shape[0], cols // scale.shape[1])
    want = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not tile a {tuple(weight.shape)} weight in {block} blocks"
        )
    scale = scale.to(torch.float32)
    if rows % block[0] == 0 and cols % block[1] == 0:  # the same products, without a grid of the weight's size
        tiles = weight.to(torch.float32).view(want[0], block[0], want[1], block[1])
        return (tiles * scale[:, None, :, None]).view(rows, cols).to(dtype)
    grid = scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return (weight.to(torch.float32) * grid[:rows, :cols]).to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """An FP4 weight [rows, cols / 2] (int8: two e2m1 values a byte, the low nibble first) as fp32 [rows, cols]."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    bytes_ = packed.contiguous().view(torch.uint8).long()
    return torch.stack((table[bytes_ & 0xF], table[bytes_ >> 4]), dim=-1).reshape(*packed.shape[:-1], -1)


def mxfp4_to_plain(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An MXFP4 expert tensor as transformers dequantizes it (x @ W layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def int4_to_plain(
    packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """A pack-quantized INT4 weight (`weight_packed`, `weight_scale`, `weight_shape`) as compressed-tensors
    dequantizes it: each value times its group's scale in the scale's dtype, then as `dtype`. `group` 0: per
    channel. ValueError, one line, for parts that do not fit together."""
    rows, cols = (int(n) for n in shape.tolist())
    group = group or cols
    if packed.dtype != torch.int32 or tuple(packed.shape) != (rows, -(-cols // 8)):
        raise ValueError(f"packed {packed.dtype} {tuple(packed.shape)} does not hold a {rows} x {cols} INT4 weight")
    if cols % group or tuple(scale.shape) != (rows, cols // group):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit a {rows} x {cols} weight in groups of {group}")
    nibbles = packed.contiguous().view(torch.uint8)  # each word's bytes in memory order: little-endian
    if sys.byteorder == "big":
        nibbles = nibbles.view(rows, -1, 4).flip(-1)
    values = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(torch.int8).view(rows, -1)[:, :cols] - 8
    grouped = values.to(scale.dtype).view(rows, cols // group, group) * scale.unsqueeze(-1)
    return grouped.view(rows, cols).to(dtype)


class FP8Weight(HeldWeight):
    """An FP8 weight [..., rows, cols] (e4m3; or DeepSeek-V4's FP4 as int8 [..., rows, cols / 2]) and its scales
    (fp32, or one-byte power-of-two exponents) over `block`s (None: the scale's grid cuts the weight), as stored on
    the hub; `shape` is the dequantized weight's."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, plain_dtype):
        super().__init__()
        self.block, self.plain_dtype = block, plain_dtype
        self.stored = (weight.dtype, tuple(weight.shape), scale.dtype, tuple(scale.shape))
        fp4 = weight.dtype == torch.int8
        self.shape = (*weight.shape[:-1], weight.shape[-1] * 2) if fp4 else tuple(weight.shape)
        self.register_buffer("codes", as_bytes(weight), persistent=False)
        self.register_buffer("scales", as_bytes(scale), persistent=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        w_dtype, w_shape, s_dtype, s_shape = self.stored
        weight, scale = self.codes.view(w_dtype).view(w_shape), self.scales.view(s_dtype).view(s_shape)
        return dequantize(weight, scale, self.block, self.plain_dtype).to(dtype or self.plain_dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, {self.stored[0]}, block={self.block}"


class MXFP4Weight(HeldWeight):
    """gpt-oss's MXFP4 expert tensor: `blocks` [E, rows, n, 16] (two e2m1 values a byte) and `scales` [E, rows, n]
    (power-of-two exponents + 127); `shape` is the dequantized tensor's, [E, n * 32, rows] (x @ W)."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, plain_dtype):
        super().__init__()
        self.plain_dtype, self.stored = plain_dtype, (tuple(blocks.shape), tuple(scales.shape))
        self.shape = (blocks.shape[0], blocks.shape[2] * blocks.shape[3] * 2, blocks.shape[1])
        self.register_buffer("blocks", blocks.contiguous(), persistent=False)
        self.register_buffer("scales", scales.contiguous(), persistent=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return mxfp4_to_plain(self.blocks, self.scales, self.plain_dtype).to(dtype or self.plain_dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, mxfp4"


class INT4Weight(HeldWeight):
    """A pack-quantized INT4 weight [..., rows, cols] (compressed-tensors' `weight_packed` int32 [..., rows, cols / 8]
    and `weight_scale` [..., rows, cols / group]; `group` 0: one scale a row), as Kimi K2 Thinking and K2.5 store
    their routed experts; experts stacked along a leading dimension, dequantized one at a time."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, cols: int, group: int, plain_dtype):
        super().__init__()
        self.group, self.plain_dtype = group, plain_dtype
        self.shape = (*packed.shape[:-1], cols)
        self.stored = (tuple(packed.shape), scale.dtype, tuple(scale.shape))
        self.register_buffer("packed", as_bytes(packed), persistent=False)
        self.register_buffer("scale", as_bytes(scale), persistent=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        p_shape, s_dtype, s_shape = self.stored
        packed, scale = self.packed.view(torch.int32).view(p_shape), self.scale.view(s_dtype).view(s_shape)
        rows, cols = self.shape[-2:]
        size = torch.tensor([rows, cols])
        out = torch.empty(self.shape, dtype=self.plain_dtype, device=packed.device)
        matrices = zip(packed.reshape(-1, *p_shape[-2:]), scale.reshape(-1, *s_shape[-2:]), strict=True)
        for piece, (p, s) in zip(out.view(-1, rows, cols), matrices, strict=True):  # one expert's matrix at a time
            piece.copy_(int4_to_plain(p, s, size, self.group, self.plain_dtype))
        return out.to(dtype or self.plain_dtype)

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, int4, group={self.group or 'per row'}"


def int4_bytes(rows: int, cols: int, group: int, scale_bytes: int = 2) -> int:
    """What `INT4Weight` holds for a [rows, cols] weight: half a byte a weight, one scale (bf16) a group."""
    return rows * -(-cols // 8) * 4 + rows * (cols // (group or cols)) * scale_bytes


def fp8_bytes(rows: int, cols: int, block: tuple[int, int] | None) -> int:
    """What `FP8Weight` holds for a [rows, cols] weight: a byte a weight and one fp32 scale a block (per tensor:
    one)."""
    return rows * cols + 4 * (-(-rows // block[0]) * -(-cols // block[1]) if block else 1)


def fp4_bytes(rows: int, cols: int) -> int:
    """What `FP8Weight` holds for DeepSeek-V4's FP4 [rows, cols] weight: half a byte a weight, a one-byte scale a row
    and 32 columns."""
    return rows * cols // 2 + rows * (cols // 32)


def mxfp4_bytes(numel: int) -> int:
    """What `MXFP4Weight` holds for `numel` weights: half a byte each and one byte of scale per 32 (4.25 bits)."""
    return numel // 2 + numel // 32
