"""A fork server for the tests' launches: the ranks of `torchrun --nproc_per_node N script ...` and the process of
`python trainer.py ...`, forked from one process that has already imported torch, transformers and DeepSpeed.

Why: a test launch is mostly imports. A rank spends ~4.5 CPU seconds importing torch, transformers' model code and
DeepSpeed before it trains a tiny model for a fraction of a second, and torchrun's agent imports torch again; the
suite makes ~150 launches. Forked from a process that holds those modules, a 2-rank launch of a 3-step run measured
1.5-1.8 CPU-s instead of 14.1-14.7 with torchrun, with bit-identical metrics and layer files. PyTorch's own
distributed tests fork their ranks the same way (`MultiProcessTestCase`).

What each rank gets is what torchrun gives it: its own process (fork, not a thread), the caller's whole environment
plus RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (none of them for a plain
`python script` launch), the working directory, `sys.argv`, the script run as `__main__`, stdout and stderr on the
launch's two streams (shared by the ranks, appended to). The exit code is the interpreter's for that script (an
uncaught exception prints its traceback and gives 1, `SystemExit` as Python maps it); when a rank fails the others
get SIGTERM, as torchrun's agent sends, and the launch's code is 1 (torchrun's; a single process keeps its own).

What differs from a fresh interpreter (the tests that depend on it keep the real launchers: the `deepspeed`
launcher's tests, a failed or hung rank, rendezvous, hostfile, SLURM, the deterministic kills of a save): every rank
shares the server's hash seed (fresh processes each draw one); variables read at import time (OMP_NUM_THREADS,
DS_ACCELERATOR, HF_*) are the server's; a rank's peak RSS starts at the server's; hydra answers that a config leaves
`hydra.mode` unset without composing it once more to see (`_mode_without_composing`). `TEST_LAUNCHER=subprocess`
runs every launch through torchrun and python instead.

A launch can also be detached (`Zygote.start`): the ranks of one job in one process group of their own, which a
test signals or SIGKILLs whole as it would a launcher started in its own session (the random SIGKILLs of saves,
SIGTERM at a step boundary).

The server: `python -m tests.zygote`, one per pytest process, single-threaded (it imports, then only forks and
waits: see PRELOAD), talking JSON lines over its stdin and a private copy of its stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# What a rank of the trainer or of a test worker imports. Not pyarrow or datasets: pyarrow starts a thread at import
# (jemalloc's), and a fork copies no thread; the trainer imports them only for parquet and datasets sources.
PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.llama4.modeling_llama4",
    "deepspeed",
    "deepspeed.runtime.pipe",
    "deepspeed.runtime.pipe.engine",
    "deepspeed.runtime.sequence_parallel.ulysses_sp",
    # DeepSpeed imports it when a ZeRO run checks its optimizer (is_zero_supported_optimizer), and its decorators
    # import torch.compile's inductor: 2.2-3.5 s in every rank of every ZeRO launch.
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "hydra",
    "omegaconf",
    "peft",
    "safetensors.torch",
    "sentencepiece",
    "tokenizers",
    "schema.compose",
    "schema.train",
    "training.assembly",
    "training.distributed",
    "training.engine",
    "training.loop",
    "training.zero_bubble_engine",
    "models.context_parallel",
    "models.lora",
    "models.pipeline",
]
TERM_GRACE = 30.0  # seconds between SIGTERM and SIGKILL for the other ranks of a failed launch (torchrun's)


# ---------------------------------------------------------------------------------------------------- server


_REPLIES: list = []  # the server's protocol stream (a rank closes it)


def _run_rank(request: dict, rank: int, out_fd: int, err_fd: int) -> None:
    """In the forked child: become rank `rank` of the launch and run the script; never returns."""
    code = 1
    try:
        if not request.get("detach"):  # a detached job is one process group, its ranks included (`_detach`)
            os.setpgid(0, 0)  # the launch kills a rank with whatever it started (data workers)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for stream in _REPLIES:
            os.close(stream.fileno())
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the server's stdin carries the requests
        os.close(null)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.close(out_fd)
        os.close(err_fd)
        env = dict(request["env"])
        n = request["nprocs"]
        if request["ranks"]:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n),
                GROUP_RANK="0",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(request["port"]),
            )
        env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # what importing deepspeed set in a fresh process
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        import runpy

        try:
            if request["script"].startswith("-m "):  # `python -m module args`: the working directory first
                module = request["script"].removeprefix("-m ")
                sys.argv, sys.path[0] = [module, *request["args"]], os.getcwd()
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                script = os.path.abspath(request["script"])
                sys.argv = [request["script"], *request["args"]]
                sys.path[0] = os.path.dirname(script)  # as `python script` puts the script's directory first
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:  # as the interpreter maps it
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit
        import threading

        threading._shutdown()  # the interpreter's exit: wait for non-daemon threads, then the atexit callbacks
        atexit._run_exitfuncs()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _signal_groups(pids, sig, groups: bool = True) -> None:
    """Signal each rank's process group (`groups`; what it started too), or each rank alone (a detached job's ranks
    share its group)."""
    for pid in pids:
        try:
            os.killpg(pid, sig) if groups else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _launch(request: dict) -> dict:
    """Fork the launch's ranks, wait for them (timeout: kill them all); the exit code and whether it timed out."""
    streams = [os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for name in ("stdout", "stderr")]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(request["nprocs"]):
        pid = os.fork()
        if pid == 0:
            _run_rank(request, rank, *streams)
        pids[pid] = rank
    for fd in streams:
        os.close(fd)
    deadline = time.monotonic() + request["timeout"]
    codes: dict[int, int] = {}
    running, term_at, timed_out, cpu = set(pids), None, False, 0.0
    groups = not request.get("detach")
    while running:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline:
                _signal_groups(running, signal.SIGKILL, groups)
                timed_out, deadline = True, float("inf")
            elif term_at is not None and now > term_at:
                _signal_groups(running, signal.SIGKILL, groups)
                term_at = float("inf")
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        cpu += usage.ru_utime + usage.ru_stime  # the rank's, with its children that it waited for
        running.discard(pid)
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and term_at is None and running:  # torchrun's agent stops the others
            _signal_groups(running, signal.SIGTERM, groups)
            term_at = time.monotonic() + TERM_GRACE
    if request["nprocs"] == 1 and not request["ranks"]:
        code = codes[0]
    else:
        code = 0 if all(c == 0 for c in codes.values()) else 1
    codes = [codes[r] for r in range(request["nprocs"])]
    return {"returncode": code, "timed_out": timed_out, "codes": codes, "cpu_seconds": cpu}


def _detach(request: dict) -> dict:
    """Start the launch in a child of its own session and answer at once with the child's pid. The job is one process
    group, its ranks and what they start included, as a launcher started with `start_new_session` is:
    `os.killpg(pid, SIGKILL)` stops all of it at once. The child writes the launch's exit code to `status` at the end
    (a job killed whole writes nothing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return {"pid": pid}
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        # the protocol's streams are the server's alone, and the caller's output waits for no job left running
        for fd in (0, 1, 2, *(stream.fileno() for stream in _REPLIES)):
            os.dup2(null, fd)
        os.close(null)
        code = _launch(request)["returncode"]
    finally:
        try:
            with open(request["status"] + ".tmp", "w") as f:
                f.write(str(code))
            os.replace(request["status"] + ".tmp", request["status"])
        finally:
            os._exit(code)


def _mode_without_composing() -> None:
    """hydra composes a launch's whole config twice in every rank: first only to read `hydra.mode` (RUN, MULTIRUN
    or unset; `Hydra.get_mode`, 0.13-0.19 CPU-s here), then for the run. The trainer's configs leave it unset, and
    hydra then runs one job, or a sweep with `-m`: the answer without the first compose, unless an override names
    `hydra.mode`."""
    from hydra._internal.hydra import Hydra

    get_mode = Hydra.get_mode

    def mode(self, config_name, overrides):
        if any(o.lstrip("+~").startswith("hydra.mode") for o in overrides):
            return get_mode(self, config_name, overrides)
        return None

    Hydra.get_mode = mode


def serve() -> None:
    """Import PRELOAD, say "ready", then run one launch per request line until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")  # the protocol's; fd 1 itself goes to stderr (imports print)
    _REPLIES.append(replies)
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
    _mode_without_composing()
    from schema.compose import CONF_DIR, check_overrides
    from schema.train import register_configs

    register_configs()  # what every trainer rank does first (80 ms), done once here: a fork finds it done
    check_overrides([], CONF_DIR)
    import gc
    import threading

    # What the imports made lives as long as the server: out of the collector's sight, a rank's collections (and
    # DeepSpeed's bf16 optimizer calls gc.collect() 8 times on rank 0) traverse only what the rank made, and write
    # no reference count bits into the pages the ranks share with the server (Python's advice for fork servers).
    gc.collect()
    gc.freeze()
    assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1, (
        "a preloaded module started a thread"
    )
    replies.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    replies.flush()
    for line in sys.stdin:
        request = json.loads(line)
        reply = _detach(request) if request.get("detach") else _launch(request)
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# ---------------------------------------------------------------------------------------------------- client


class Zygote:
    """The client: one server per process that uses it, started on first use."""

    def __init__(self, env: dict):
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.cpu_seconds = 0.0  # the ranks' so far (benchmarks/suite_census.py reads it with `launches`)
        self.launches: list[str] = []

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote"],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready or not json.loads(ready).get("ready"):
            raise RuntimeError(f"the test fork server did not start (exit {self.proc.poll()})")

    def run(
        self, script: str, args: list[str], nprocs: int, ranks: bool, env: dict, port: int = 0, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        """Launch `script args` as `nprocs` ranks (`ranks`: with torchrun's variables) in `env` from the repository
        root; returns what `subprocess.run(..., capture_output=True, text=True)` would."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        cmd = [script, *args]
        with tempfile.TemporaryDirectory(prefix="zygote-") as logs:
            request = {
                "script": script,
                "args": list(args),
                "nprocs": nprocs,
                "ranks": ranks,
                "env": env,
                "port": port,
                "cwd": str(REPO),
                "timeout": timeout,
                "stdout": os.path.join(logs, "stdout"),
                "stderr": os.path.join(logs, "stderr"),
            }
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the test fork server exited ({self.proc.poll()}) during {cmd}")
            reply = json.loads(line)
            self.cpu_seconds += reply["cpu_seconds"]
            self.launches.append(f"fork{nprocs}")
            out, err = (Path(request[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(cmd, timeout, out, err)
        return subprocess.CompletedProcess(cmd, reply["returncode"], out, err)

    def start(
        self, script: str, args: list[str], nprocs: int, env: dict, log: str, port: int = 0, timeout: float = 600
    ) -> Detached:
        """Launch `script args` as `nprocs` ranks with torchrun's variables and return at once (`_detach`): both
        streams appended to `log`."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        open(log, "w").close()  # there when this returns, emptied, as `subprocess.Popen(..., stdout=open(log, "w"))`
        status = f"{log}.exit"  # beside the log: its exit code, once it ends (not an earlier job's)
        if os.path.exists(status):
            os.remove(status)
        request = {
            "script": script,
            "args": list(args),
            "nprocs": nprocs,
            "ranks": True,
            "env": env,
            "port": port,
            "cwd": str(REPO),
            "timeout": timeout,
            "stdout": log,
            "stderr": log,
            "detach": True,
            "status": status,
        }
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test fork server exited ({self.proc.poll()}) starting {script}")
        self.launches.append(f"fork{nprocs}")
        return Detached(json.loads(line)["pid"], status)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Detached:
    """A detached launch (`Zygote.start`), as much of `subprocess.Popen` as the fault tests use: `pid` (the job's
    process group), `poll`, `wait`, `returncode` (-9 for a job killed whole, which leaves no exit code)."""

    def __init__(self, pid: int, status: str):
        self.pid, self.status, self.returncode = pid, status, None

    def _code(self) -> int | None:
        try:
            return int(Path(self.status).read_text())
        except (OSError, ValueError):
            return None

    def poll(self) -> int | None:
        if self.returncode is None:
            code = self._code()
            if code is None and not _alive(self.pid):
                code = self._code()  # it may have written its code and exited between the two looks
                code = -signal.SIGKILL if code is None else code
            self.returncode = code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"detached launch {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a child of the server that exited stays a zombie until the server reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    serve()
