"""Reusable byte buffers for tensors that are read, written and dropped, one layer after another.

A fresh `torch.empty` of a few hundred MB is fresh pages: the kernel faults every 4 KiB page in on
first touch (3.4 M page faults per conversion of a 7B model), which on the machine we measured
cost about as much as reading the data from disk. Conversion reads the
same tensor sizes again and again (every decoder layer has the same shapes), so a buffer freed when
its layer is written is handed to the next layer's tensor of the same size.

Memory: the pool keeps only buffers it lent and got back, and drops them when a new buffer would make
the pool and the loans together exceed the most ever lent at once: conversion holds no more than
it did with fresh buffers.
"""

from __future__ import annotations

import torch


class BufferPool:
    """`take(nbytes)` a uint8 tensor that owns exactly `nbytes`; `give(tensor)` its storage back when done."""

    def __init__(self):
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lent: dict[int, int] = {}  # data pointer -> bytes, of buffers out on loan
        self.free_bytes = self.lent_bytes = self.peak_lent_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            buf = free.pop()
            self.free_bytes -= nbytes
        else:
            # A new buffer: drop free ones (of other sizes) until the pool and the loans together fit in the
            # most ever lent at once, this loan included.
            self.peak_lent_bytes = max(self.peak_lent_bytes, self.lent_bytes + nbytes)
            for size in sorted(self._free, reverse=True):
                while self._free[size] and self.free_bytes + self.lent_bytes + nbytes > self.peak_lent_bytes:
                    self._free[size].pop()
                    self.free_bytes -= size
            buf = torch.empty(nbytes, dtype=torch.uint8)
        self._lent[buf.data_ptr()] = nbytes
        self.lent_bytes += nbytes
        return buf

    def give(self, tensor: torch.Tensor) -> None:
        """Return the buffer under `tensor` (any view of a buffer this pool lent); other tensors are ignored.
        The caller must hold no other reference to the data: the next `take` overwrites it."""
        storage = tensor.untyped_storage()
        nbytes = self._lent.pop(storage.data_ptr(), None)
        if nbytes is None:
            return
        self.lent_bytes -= nbytes
        self.free_bytes += nbytes
        self._free.setdefault(nbytes, []).append(torch.empty(0, dtype=torch.uint8).set_(storage))
