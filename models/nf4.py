"""QLoRA's frozen base: a decoder's linear weights held as bitsandbytes NF4 (4-bit NormalFloat, one fp32 absmax a
block of 64 weights, or with `double` those absmax themselves 8-bit quantized in blocks of 256), dequantized at each
matmul. The arithmetic is bitsandbytes' own (its quantize and dequantize ops, and `MatMul4Bit`'s forward and
backward written out), so a model that transformers quantized with `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4")` and ours compute with the same weights, bit for bit.

Which layers: those transformers' `replace_with_bnb_linear` converts, every layer of exactly `nn.Linear`'s type
(ours: a tensor-parallel row layer too, `RowParallelLinear`, whose class only adds the reduction) whose name the
family's `_keep_in_fp32_modules` does not name; and, beyond transformers (whose integration leaves them in bf16), the
routed experts' fused tensors (`quantize_experts`). Embeddings, the head and norms stay in the run's precision. Each
tensor-parallel rank quantizes the shard it holds (a block of 64 never straddles two ranks); when a row layer's
shard holds a multiple of 64 columns, as every real model's does, the blocks are those of the whole weight.

A quantized layer holds its weight as models/frozen_weights.py says (dequantized at each matmul, stored as bytes,
not persistent): the base is quantized again from its source at every start, deterministically.

Model code only: no distributed code. bitsandbytes is optional; `require_bitsandbytes` says so in one line.
"""

from __future__ import annotations

import torch
from torch import nn

from models.frozen_weights import HeldWeight, as_bytes, expert_weights, held_class, hold_experts, hold_linear

BLOCKSIZE = 64  # bitsandbytes' and transformers' default for 4-bit (bnb_4bit_blocksize)
NESTED_BLOCKSIZE = 256  # the absmax's own blocks under double quantization (bitsandbytes' only choice)


def require_bitsandbytes(key: str = "lora.quantize=nf4"):
    """bitsandbytes.functional, or ValueError in one line naming `key`."""
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as e:
        raise ValueError(
            f"{key} needs bitsandbytes (pip install bitsandbytes; scripts/setup.sh installs it): {e}"
        ) from None
    return bnb_functional


class NF4Weight(HeldWeight):
    """One linear layer's weight in NF4: `packed` [(out*in+1)//2, 1] uint8 and its statistics, stored as bytes (the
    NF4 code book is bitsandbytes' own constant).
    `shape` is the weight's [out, in]; `source_dtype` the dtype it was quantized from (bitsandbytes' QuantState
    dtype). `device` and `dtype` (uint8: what is stored) answer as a tensor's would, for PEFT's adapter placement."""

    def __init__(self, weight: torch.Tensor, double: bool = False):
        super().__init__()
        bnb = require_bitsandbytes()
        packed, state = bnb.quantize_4bit(
            weight.detach(), blocksize=BLOCKSIZE, compress_statistics=double, quant_type="nf4"
        )
        self.shape, self.source_dtype, self.nested = tuple(weight.shape), weight.dtype, state.nested
        self.register_buffer("packed", packed, persistent=False)
        if state.nested:  # absmax as uint8 codes, with its own fp32 absmax per 256, code book and offset
            self.register_buffer("absmax", state.absmax, persistent=False)
            self.register_buffer("absmax2", as_bytes(state.state2.absmax), persistent=False)
            self.register_buffer("code2", as_bytes(state.state2.code), persistent=False)
            self.register_buffer("offset", as_bytes(state.offset.reshape(1)), persistent=False)
        else:
            self.register_buffer("absmax", as_bytes(state.absmax), persistent=False)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] as bitsandbytes' `gemm_4bit` dequantizes it for a `dtype` input (default: the
        dtype it was quantized from); nested statistics first as its `dequantize_blockwise` does."""
        ops, f32 = torch.ops.bitsandbytes, torch.float32
        if self.nested:  # the absmax's 8-bit codes, their fp32 scales per 256 and code book, plus the offset
            absmax = ops.dequantize_blockwise.default(
                self.absmax, self.absmax2.view(f32), self.code2.view(f32), NESTED_BLOCKSIZE, f32
            )
            absmax = absmax + self.offset.view(f32)
        else:
            absmax = self.absmax.view(f32)
        return ops.dequantize_4bit.default(
            self.packed, absmax, BLOCKSIZE, "nf4", list(self.shape), dtype or self.source_dtype
        )

    def extra_repr(self) -> str:
        return f"shape={list(self.shape)}, nf4, blocksize={BLOCKSIZE}, double={self.nested}"


def quantize_linear(layer: nn.Linear, double: bool = False) -> None:
    """Hold `layer`'s weight in NF4, in place (its class becomes the held one; its bias stays)."""
    if held_class(type(layer)) is None:
        raise ValueError(f"{type(layer).__name__} cannot be held in NF4")
    hold_linear(layer, NF4Weight(layer.weight.data, double))


def nf4_linears(layer: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers of one decoder layer that transformers' bitsandbytes integration converts (see the module's
    docstring), by name: what `quantize_stage` quantizes and the planner counts."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    from models.families import FAMILIES
    from models.layers import block_index

    family = next(f for f in FAMILIES.values() if isinstance(layer, f.hf_class("DecoderLayer")))
    kept = sorted(family.fp32_in_fp16())  # transformers' `_keep_in_fp32_modules`: not converted
    block = block_index(layer)
    return [
        (name, linear)
        for name, linear in layer.named_modules()
        if isinstance(linear, nn.Linear)
        and held_class(type(linear)) is not None
        and should_convert_module(f"model.layers.{block}.{name}", kept)
    ]


def nf4_experts(layer: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(the sparse block, its experts module: transformers' fused [E, ., .] tensors) of a decoder layer, or None."""
    from models.families import FAMILIES

    family = next(f for f in FAMILIES.values() if isinstance(layer, f.hf_class("DecoderLayer")))
    if family.moe is None:
        return None
    block = getattr(layer, family.moe.block, None) if family.moe.block else layer
    experts = getattr(block, "experts", None)
    return (block, experts) if experts is not None and expert_weights(experts) else None


def quantize_experts(experts: nn.Module, double: bool = False, block: nn.Module | None = None) -> None:
    """Hold an experts module's fused weights ([E, ., .]: this rank's experts, each its own blocks where a matrix
    holds a multiple of 64 weights) in NF4, in place; biases stay; dequantized at each call of the sparse `block`
    (models/frozen_weights.py `hold_experts`)."""
    held = {name: NF4Weight(getattr(experts, name).data, double) for name in expert_weights(experts)}
    hold_experts(experts, held, block)


def quantize_stage(module: nn.Module, double: bool = False, experts: bool = True) -> int:
    """Hold in NF4 the `nf4_linears` of every decoder layer in `module`, after their weights are loaded, and with
    `experts` each sparse block's experts (`quantize_experts`; transformers' bitsandbytes integration leaves them).
    Returns how many modules it quantized."""
    from models.families import hf_classes

    count = 0
    for layer in [m for m in module.modules() if isinstance(m, hf_classes("DecoderLayer"))]:
        for _, linear in nf4_linears(layer):
            if not isinstance(linear.weight, NF4Weight):
                quantize_linear(linear, double)
                count += 1
        sparse = nf4_experts(layer) if experts else None
        if sparse is not None and not hasattr(sparse[1], "held_weights"):
            quantize_experts(sparse[1], double, block=sparse[0])
            count += 1
    return count


def nf4_refusal(config) -> str | None:
    """Why `lora.quantize=nf4` cannot hold a model of `config`'s family (a decoder layer with no linear layer that
    bitsandbytes converts), or None. On the meta device."""
    from models.layers import build_layer
    from models.partition import layer_shape
    from models.pipe_layout import DECODER, pipe_layers

    seen = set()
    with torch.device("meta"):
        for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
            shape = layer_shape(layer, config)
            if layer.kind != DECODER or shape in seen:
                continue
            seen.add(shape)
            if not nf4_linears(build_layer(layer, config)):
                return f"{config.model_type}'s decoder layer {layer.block} has no linear layer NF4 can hold"
    return None


def nf4_bytes(numel: int, double: bool = False) -> int:
    """What `NF4Weight` holds for a weight of `numel` elements: the packed codes (two a byte) and one fp32 absmax
    per block of 64, or with `double` one uint8 per block with an fp32 absmax per 256
    blocks, its 256-value code book and an offset (4.5 and about 4.13 bits a weight)."""
    blocks = -(-numel // BLOCKSIZE)
    absmax = blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4 * 256 + 4 if double else 4 * blocks
    return -(-numel // 2) + absmax
