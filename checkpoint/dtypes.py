"""The one dtype table: command-line names, torch dtypes and safetensors codes, both directions."""

from __future__ import annotations

import torch

# --dtype names (also `deepspeed.precision` values) -> torch dtypes.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# torch dtype -> safetensors header code (little-endian, as are the machines we run on).
SAFETENSORS_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",  # FP8 hub weights (DeepSeek-V3's), dequantized at conversion
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",  # power-of-two block scales (DeepSeek-V4's `scale_fmt: ue8m0`)
}
SAFETENSORS_DTYPES = {code: dtype for dtype, code in SAFETENSORS_CODES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the spelling of config.json's `dtype`."""
    return str(dtype).removeprefix("torch.")


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
