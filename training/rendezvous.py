"""A job's rendezvous is its own: ranks of two jobs sharing a node and a port never meet.

`deepspeed --num_gpus N trainer.py` puts every job on port 29500 unless `--master_port` says otherwise. With
torch's `env://` start-up, a second job's rank 0 cannot bind the port (a DistNetworkError traceback), while its other
ranks connect to the first job's store and take part in its rendezvous: the first job dies with "Connection reset
by peer" or waits forever. Here the start-up is ours (then `init_process_group(store=...)`):

- rank 0 hosts the store (a client too under torchrun, whose agent hosts it); a port already taken is one line
  naming the address and port and how to choose another;
- every rank claims the store for its job (`compare_set` of JOB_KEY to the job's key: a hash of the real path of
  `output_dir`, which no two live runs share, and inside an srun step SLURM's job and step ids); a rank
  that finds another job's key there stops with the same kind of line; so does a second rank with the same number
  (another launch of the same job on the same port);
- each job works under its own prefix of the store, so nothing of another job's is ever read;
- under torchrun the agent binds the port and meets the ranks (a new store each restart round): its store is used
  as torch's env:// start-up uses it;
- every rank waits until all have arrived, at most `dist_init_timeout_minutes` (a rank that never arrives: one
  line), before the process group is built with the collective timeout (`dist_timeout_minutes`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from datetime import timedelta

from torch.distributed import DistError, HashStore, PrefixStore, Store, TCPStore

from training.errors import RunError
from training.launch_env import slurm_step

JOB_KEY = "trainer-rendezvous/job"  # the store's owner: the job key its host (rank 0) sets
HOW = "choose another port with `deepspeed --master_port N`, or MASTER_PORT=N under torchrun/SLURM"


def job_key(output_dir: str, environ) -> str:
    """What every rank of one job shares and no two live jobs share (see the module docstring)."""
    parts = [os.path.realpath(output_dir), environ.get("WORLD_SIZE", "")]
    if slurm_step(environ):  # (nodes an ssh launcher starts inside an allocation may lack SLURM's variables)
        parts += [environ.get(k, "") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _wait_for_listener(addr: str, port: int, deadline: float, minutes: float) -> None:
    """Until something accepts connections at addr:port (torch's own client retries print C++ stacks)."""
    delay = 0.05
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5):
                return
        except OSError:
            if time.monotonic() + delay > deadline:
                raise RunError(
                    f"nothing answers at {addr}:{port} after dist_init_timeout_minutes={minutes:g}: is rank 0 "
                    "running, and do MASTER_ADDR and the port agree on every node?"
                ) from None
            time.sleep(delay)
            delay = min(1.0, delay * 2)


def _hosts(rank: int, environ) -> bool:
    """Whether this rank hosts the store (rank 0, except under torchrun, whose agent hosts it)."""
    return rank == 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _open_store(rank: int, world: int, addr: str, port: int, minutes: float, deadline: float, environ) -> Store:
    timeout = timedelta(minutes=minutes)
    if _hosts(rank, environ):
        try:
            return TCPStore(addr, port, world, True, timeout=timeout, wait_for_workers=False, multi_tenant=True)
        except DistError as e:
            if "EADDRINUSE" in str(e) or "in use" in str(e):
                raise RunError(f"port {port} on {addr} is taken by another process (another job?): {HOW}") from None
            raise RunError(f"cannot host the rendezvous at {addr}:{port}: {str(e).splitlines()[0]}") from None
    _wait_for_listener(addr, port, deadline, minutes)
    try:
        return TCPStore(addr, port, world, False, timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except DistError as e:
        raise RunError(
            f"{addr}:{port} answers but is not this job's rendezvous ({str(e).splitlines()[0][:120]}): {HOW}"
        ) from None


def _appears(store: Store, key: str, deadline: float) -> bool:
    """Whether `key` is set in `store` before `deadline` (polled: torch's blocking wait prints a stack on timeout)."""
    delay = 0.05
    while not store.check([key]):
        if time.monotonic() + delay > deadline:
            return False
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)
    return True


def rendezvous(rank: int, world: int, output_dir: str, minutes: float, environ=os.environ) -> Store:
    """Meet every rank of this job (module docstring); returns the job's own store for `init_process_group`.

    Raises:
        RunError: the port belongs to another job, or not every rank arrived within `minutes`.
    """
    if not (minutes > 0 and minutes < float("inf")):
        raise RunError(f"dist_init_timeout_minutes={minutes}: must be a positive number of minutes")
    if world == 1:
        return HashStore()
    addr, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    deadline = time.monotonic() + minutes * 60  # for the whole start-up: connecting, claiming, every rank arriving
    store = _open_store(rank, world, addr, port, minutes, deadline, environ)
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent bound the port and met the ranks already; it makes a new store for each restart round,
        # as torch's own env:// start-up assumes: nothing to claim.
        return store
    try:
        return _meet(store, rank, world, addr, port, minutes, deadline, output_dir, environ)
    except DistError:  # the host (rank 0) stopped: its own line names the cause
        raise RunError(f"lost the rendezvous at {addr}:{port}: rank 0 stopped (its error names the cause)") from None


def _meet(
    store: Store, rank: int, world: int, addr: str, port: int, minutes: float, deadline: float, output_dir: str, environ
):
    key = job_key(output_dir, environ)
    if rank == 0:  # only the host claims its store (a foreign rank connecting first must not)
        store.set(JOB_KEY, key)
    elif not _appears(store, JOB_KEY, deadline):
        raise RunError(f"{addr}:{port} is not a rendezvous of this trainer (no job claims it): {HOW}")
    if store.get(JOB_KEY).decode() != key:
        raise RunError(f"port {port} on {addr} belongs to another job (the rendezvous of another output_dir): {HOW}")
    prefix = f"{JOB_KEY}/{key}/"
    if store.add(f"{prefix}rank{rank}", 1) > 1:
        raise RunError(
            f"rank {rank} of this job is already at {addr}:{port}: another launch of the same run (same output_dir) "
            f"uses the port; {HOW}"
        )
    if store.add(f"{prefix}arrived", 1) == world:
        store.set(f"{prefix}all", "1")
    if not _appears(store, f"{prefix}all", deadline):
        arrived = store.add(f"{prefix}arrived", 0)
        raise RunError(
            f"{arrived} of {world} ranks reached the rendezvous at {addr}:{port} within "
            f"dist_init_timeout_minutes={minutes:g}: a rank did not start, or is at another address or port"
        )
    return PrefixStore(prefix, store)
