"""A save's files written off the training thread: snapshot now, write, fsync and describe in the background.

`HostSnapshot.copy(obj)` copies every tensor of a (nested) state into host memory the training step no longer
touches: buffers kept from one save to the next, so a steady run allocates them once. A GPU tensor's buffer is pinned
(`pinned_empty`), so its copies run asynchronously until `ready()`. `BackgroundWriter` takes the files of one save
(`write(jobs)`), writes them in order on one thread with `torch.save`, flushes each to disk and describes it for the
manifest (size, hash, tensor shapes: checkpoint/manifest.py) while the training thread goes on. Python objects in a
state are copied too (containers rebuilt, other objects deep-copied; numbers, strings and enums kept as they are).

No process group here: agreeing that every rank's files are durable, and publishing, is the trainer's
(training/async_save.py).
"""

from __future__ import annotations

import copy
import enum
import json
import math
import mmap
import os
import threading
import time
import weakref

import torch

from checkpoint.direct_io import DirectFile
from checkpoint.hashing import new_digest
from checkpoint.layer_files import unchecked_zip_records
from checkpoint.manifest import describe_file
from checkpoint.staging import write_text_atomic

IMMUTABLE = (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device, range)


class HostSnapshot:
    """Copies of states in reusable host buffers, keyed by file name and position in the state."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.pending_device_copies = False

    def copy(self, obj, key: tuple = ()):
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj.detach(), key)
        if isinstance(obj, dict):
            out = type(obj)((k, self.copy(v, (*key, k))) for k, v in obj.items())
            if hasattr(obj, "_metadata"):  # a module state dict's per-module versions
                out._metadata = copy.deepcopy(obj._metadata)
            return out
        if isinstance(obj, (list, tuple)):
            copied = [self.copy(v, (*key, i)) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return copied
            if type(obj) is tuple:
                return tuple(copied)
            return type(obj)(*copied) if hasattr(obj, "_fields") else type(obj)(copied)  # named tuple; torch.Size
        if obj is None or isinstance(obj, IMMUTABLE):
            return obj
        # Any other object (DeepSpeed's dynamic loss scaler, say) changes with the next steps: copied now too.
        return copy.deepcopy(obj)

    def _tensor(self, t: torch.Tensor, key: tuple) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            # Compact: a view's whole storage is never kept.
            buf = pinned_empty(t.shape, t.dtype) if t.is_cuda else torch.empty(t.shape, dtype=t.dtype)
            self.buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        self.pending_device_copies |= t.is_cuda
        return buf

    def ready(self) -> None:
        """Wait for the asynchronous device-to-host copies (the only GPU wait of a save)."""
        if self.pending_device_copies:
            torch.cuda.synchronize()
            self.pending_device_copies = False


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """A host tensor for copies from a GPU: zeroed, then page-locked in place (cudaHostRegister, as
    torch.distributed.checkpoint's pinned staging does). Measured on an H200 node (docs/measured.md): the driver
    copies into untouched pageable memory at 1.0 GiB/s and allocates pinned memory at 1.4 GiB/s, which made the first
    save of 15 GiB block the loop for 17.6-20.1 s; the CPU touched new pages at 17 GiB/s, the driver registered
    touched ones at 16 GiB/s, and copies into registered buffers ran at 51 GiB/s. The pages are a shared anonymous
    mapping of the tensor's own: registering a range that shares a page with a registered one (malloc'd buffers can)
    fails, and a fork (data-loader workers) does not copy them on write. A refusal raises, naming the call (the
    driver's error would otherwise surface at the next kernel launch); the registration is undone when the tensor
    is freed, before its pages are unmapped."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # unmapped with the tensor's storage
    raw.zero_()
    out = raw.view(dtype).view(shape)
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(out.data_ptr(), nbytes, 1)  # 1: cudaHostRegisterPortable
    if int(code) != 0:
        reason = cudart.cudaGetErrorString(code)
        raise RuntimeError(f"cudaHostRegister of a {nbytes}-byte checkpoint buffer failed: {reason}")
    unpin = weakref.finalize(out, cudart.cudaHostUnregister, out.data_ptr())
    unpin.atexit = False  # not after the CUDA context is gone
    return out


class BackgroundWriter:
    """One save's files at a time, written by a daemon thread (a failed or killed run abandons them unpublished)."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.entries: dict[str, dict] = {}
        self.error: str | None = None
        self.seconds = 0.0

    def write(self, jobs: list[tuple[str, object]], describe: bool, marker: str | None = None) -> None:
        """Start writing `jobs` ([(path, state)], states already snapshotted). One save in flight: call `wait()`
        before the next."""
        assert self.thread is None, "a background save is still in flight"
        self.entries, self.error = {}, None
        self.thread = threading.Thread(
            target=self.run_jobs, args=(jobs, describe, marker), name="checkpoint-writer", daemon=True
        )
        self.thread.start()

    def run_jobs(self, jobs, describe: bool, marker: str | None = None) -> None:
        """Write `jobs` in order on the calling thread; the first failure stops it (`error` names the file). Once all
        are durable, `marker` (a JSON file: the manifest entries and seconds) says so to whoever publishes."""
        self.entries, self.error = {}, None
        start = time.perf_counter()
        for path, state in jobs:
            try:
                hashed = write_durably(path, state)
                if describe:
                    self.entries[os.path.basename(path)] = describe_file(path, hashed=hashed)
            except Exception as e:  # noqa: BLE001 - reported on the training thread, naming the file
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).splitlines()[0]
                self.error = f"{path}: {reason}"
                break
        self.seconds = time.perf_counter() - start
        if marker and self.error is None:
            try:
                write_text_atomic(marker, json.dumps({"entries": self.entries, "seconds": self.seconds}))
            except OSError as e:
                self.error = f"{marker}: {e.strerror or e}"

    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self, timeout: float | None = None) -> tuple[dict[str, dict], str | None, float]:
        """(manifest entries, the error or None, seconds spent writing) of the save in flight, once written (or after
        `timeout` seconds, still writing)."""
        if self.thread is not None:
            self.thread.join(timeout)
            if not self.thread.is_alive():
                self.thread = None
        return self.entries, self.error, self.seconds


def write_durably(path: str, state) -> str:
    """`torch.save` to `path` without a CRC-32 per zip record (a third of torch.save's time; the manifest's hash
    guards the file), past the page cache (checkpoint/direct_io.py: a tenth of a buffered write's CPU, which the
    ranks need), then flushed to the disk (the commit publishes only durable files). Returns the file's hash,
    computed on the way out."""
    digest = new_digest()
    with unchecked_zip_records(), DirectFile(path, digest, fsync=True) as f:
        torch.save(state, f)
    return digest.hexdigest()
