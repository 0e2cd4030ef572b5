"""Process-group start-up, and agreeing on set-up failures across ranks.

Set-up work is uneven: rank 0 counts and tokenizes the data, each stage loads its own layer files,
the data ranks load the tokenizer. A rank that fails alone and exits would leave the others blocked
in their next collective until the launcher kills them with "Connection closed by peer" tracebacks.
`agreed()` wraps each such piece of work: every rank enters the same all-gather afterwards, learns
whether any rank failed, and all raise the same one-line RunError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from training.errors import USER_ERRORS, RunError
from training.launch_env import resolve_launch
from training.rendezvous import rendezvous

log = logging.getLogger("trainer")
_CONTROL: list = []  # the gloo group for small CPU collectives (made once per process group)
LAUNCH: list[str] = []  # where this process's rank and world size came from


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    timeout_minutes: float = 30.0, job_dir: str = ".", init_timeout_minutes: float = 5.0
) -> tuple[int, int]:
    """Join the process group started by `deepspeed`/`torchrun` or `srun` (training/launch_env.py), or make a
    one-rank group for `python`. `LAUNCH[0]` says where the ranks came from (the run's first log line).

    The ranks meet through the job's own rendezvous (training/rendezvous.py, keyed by `job_dir`, the run's
    output_dir), within `init_timeout_minutes`; collectives then time out after `timeout_minutes`.

    Returns:
        (global rank, world size).
    Raises:
        RunError: a SLURM environment that cannot be read; a port that belongs to another job; a rank missing.
    """
    import deepspeed

    try:
        LAUNCH[:] = [resolve_launch(os.environ)]
    except ValueError as e:
        raise RunError(str(e)) from None
    if os.environ["WORLD_SIZE"] == "1":  # a world of one: any free port on this machine
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("LOCAL_RANK", "0")  # PipelineModule reads it
    timeout = timedelta(minutes=timeout_minutes)
    # NOTE: `new_group()` without a timeout takes torch's module default (30 min), not the one given to
    # init_process_group, and DeepSpeed builds its pipeline/data groups that way: set the default too,
    # so a collective stuck on a dead or hung rank errors out after `dist_timeout_minutes` everywhere.
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    if not dist.is_initialized():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = rendezvous(rank, world, job_dir, init_timeout_minutes)
        store.set_timeout(timeout)
        dist.init_process_group(process_group_backend(), store=store, rank=rank, world_size=world, timeout=timeout)
        _without_shm_all_reduce()
        deepspeed.init_distributed(timeout=timeout, verbose=False)  # DeepSpeed's side of the group made above
        _CONTROL[:] = [dist.new_group(backend="gloo")]
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def process_group_backend() -> str:
    """The accelerator's backend for its tensors (NCCL on CUDA), with gloo beside it for CPU tensors: the loop
    reduces a few CPU scalars (a step's token counts, router and eval sums) over the data-parallel groups, which
    DeepSpeed and we make with the default backend, and NCCL alone refuses CPU tensors. gloo alone on CPU ranks."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    name, device = accelerator.communication_backend_name(), accelerator.device_name()
    return name if device == "cpu" else f"cpu:gloo,{device}:{name}"


def shutdown_distributed() -> None:
    """Destroy the process groups before the interpreter exits.

    NOTE: without it, gloo's worker threads can still hold work objects when the interpreter is torn
    down, and a rank that finished cleanly aborts with "terminate called without an active exception"
    (SIGABRT, exit -6) about once in a hundred exits (pytorch/pytorch#190489). Local for gloo: no peer waits.
    """
    if dist.is_initialized():
        _CONTROL.clear()
        dist.destroy_process_group()


def _without_shm_all_reduce() -> None:
    """Keep DeepSpeed from building its CPU shared-memory all-reduce op (`deepspeed_shm_comm`).

    NOTE: the op serves DeepSpeed's inference kernels only (`inference_all_reduce`); training's collectives go
    through the process group. Left "compatible", `deepspeed.init_distributed` JIT-compiles it with the machine's
    C++ compiler on every CPU rank (30-60 s at a machine's first launch, every rank waiting on the build lock, and
    again whenever another ninja or another path to the environment built it last), then maps a 66 MB /dev/shm
    segment per rank that it never unlinks. Marked incompatible, it is neither built nor mapped.

    The mark goes into DeepSpeed's table of compatible ops without probing the others (its probe runs the C compiler
    for async_io's libaio check: 0.09 s a rank, every launch), whose only reader is that op's builder
    (`deepspeed.comm.torch.build_shm_op`: `.get(name, False)`); a probe run before keeps its entries.
    """
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().create_op_builder("ShareMemCommBuilder") is None:  # (CUDA: none, and no probe of the ops)
        return
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


def agree(error: str | None) -> None:
    """Collective: every rank passes its one-line error (or None); if any rank failed, all raise the first."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise RunError(first)


@contextlib.contextmanager
def agreed() -> Iterator[None]:
    """Run the body on every rank (doing as much or as little as each rank needs), then agree on failure.

    The body must not enter collectives itself: a rank that failed early would not reach them.
    """
    error = None
    try:
        yield
    except USER_ERRORS as e:
        error = str(e)
    agree(error)


def broadcast_object(value, src: int = 0, group=None):
    """`value` of rank `src` on every rank (of `group`, default all)."""
    box = [value]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def control_group():
    """A gloo group over every rank for small CPU collectives (the stop flag, heartbeats), under NCCL too."""
    if not _CONTROL:
        _CONTROL.append(dist.new_group(backend="gloo"))
    return _CONTROL[0]


def _pulse(state: int) -> int:
    flag = torch.tensor([state], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
    return int(flag.item())


def ranks_work(work: Callable[[], None], interval: float = 5.0) -> None:
    """Every rank runs `work()` (however long: a download) in a thread while the ranks pulse short collectives, so
    no wait runs into `dist_timeout_minutes`; a one-line failure reaches every rank as with `agreed()`."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="ranks-work", daemon=True)
    thread.start()
    while _pulse(int(thread.is_alive())):
        thread.join(interval)
    error = outcome.get("error")
    line = str(error) if error is not None else None
    if error is not None and not isinstance(error, USER_ERRORS):  # a bug or an I/O error: every rank stops too
        log.error("rank %d: unexpected error", dist.get_rank(), exc_info=error)
        line = f"rank {dist.get_rank()}: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    agree(line)


def rank0_works(work: Callable[[Callable[[], None]], None], waiting: str, interval: float = 5.0) -> None:
    """Rank 0 runs `work(beat)` (however long: tokenizing a corpus) while every other rank waits in short
    collectives, so no wait runs into `dist_timeout_minutes`; `work` calls `beat()` often (it pulses at most
    every `interval` seconds). A one-line failure reaches every rank as with `agreed()`."""
    error = None
    if dist.get_rank() == 0:
        last = time.monotonic()

        def beat() -> None:
            nonlocal last
            if time.monotonic() - last >= interval:
                _pulse(0)
                last = time.monotonic()

        try:
            work(beat)
        except USER_ERRORS as e:
            error = str(e)
        _pulse(1)
    else:
        log.info(waiting)
        while _pulse(0) == 0:
            pass
    agree(error)
