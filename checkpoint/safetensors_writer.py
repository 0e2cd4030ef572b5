"""Write a safetensors file tensor by tensor, with the header planned up front.

`safetensors.torch.save_file` needs every tensor of a shard in memory at once (5 GB for a default
HF shard). A safetensors header only needs names, dtypes and shapes, which are known before the
data is read, so the file can be written as the tensors arrive: memory is one tensor. The bytes go past the page
cache (checkpoint/direct_io.py), as layer files do.
"""

from __future__ import annotations

import json
import math
import struct

import torch

from checkpoint.direct_io import DirectFile
from checkpoint.dtypes import SAFETENSORS_CODES, element_size


class StreamingSafetensorsWriter:
    """Usage: `with StreamingSafetensorsWriter(path, [(name, shape, dtype), ...]) as w: w.write(name, t)`.

    Tensors must be written in the planned order with the planned shape and dtype; `close` checks
    that all of them were.
    """

    def __init__(self, path: str, plan: list[tuple[str, tuple[int, ...], torch.dtype]], metadata=None):
        self.path, self.plan, self.next = path, plan, 0
        header, offset = {}, 0
        if metadata:
            header["__metadata__"] = metadata
        for name, shape, dtype in plan:
            nbytes = math.prod(shape) * element_size(dtype)
            code = SAFETENSORS_CODES[dtype]
            header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data section 8-byte aligned, as the reference writer does
        self.file = DirectFile(path)
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype = self.plan[self.next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want_name, tuple(shape), dtype):
            got = f"{name} {tuple(tensor.shape)} {tensor.dtype}"
            raise ValueError(f"{self.path}: expected {want_name} {tuple(shape)} {dtype}, got {got}")
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.plan):
            raise ValueError(f"{self.path}: {len(self.plan) - self.next} planned tensors were not written")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self.file.close(finish=False)
