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
launcher's tests, signals, hostfile, SLURM, faults): every rank shares the server's hash seed (fresh processes each
draw one), variables read at import time (OMP_NUM_THREADS, DS_ACCELERATOR, HF_*) are the server's, and a rank's
peak RSS starts at the server's. `TEST_LAUNCHER=subprocess` runs every launch through torchrun and python instead.

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
        script = os.path.abspath(request["script"])
        sys.argv = [request["script"], *request["args"]]
        sys.path[0] = os.path.dirname(script)  # as `python script` puts the script's directory first
        import runpy

        try:
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


def _signal_groups(pids, sig) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
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
    while running:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline:
                _signal_groups(running, signal.SIGKILL)
                timed_out, deadline = True, float("inf")
            elif term_at is not None and now > term_at:
                _signal_groups(running, signal.SIGKILL)
                term_at = float("inf")
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        cpu += usage.ru_utime + usage.ru_stime  # the rank's, with its children that it waited for
        running.discard(pid)
        codes[pids[pid]] = os.waitstatus_to_exitcode(status)
        if codes[pids[pid]] != 0 and term_at is None and running:  # torchrun's agent stops the others
            _signal_groups(running, signal.SIGTERM)
            term_at = time.monotonic() + TERM_GRACE
    if request["nprocs"] == 1 and not request["ranks"]:
        code = codes[0]
    else:
        code = 0 if all(c == 0 for c in codes.values()) else 1
    codes = [codes[r] for r in range(request["nprocs"])]
    return {"returncode": code, "timed_out": timed_out, "codes": codes, "cpu_seconds": cpu}


def serve() -> None:
    """Import PRELOAD, say "ready", then run one launch per request line until stdin closes."""
    replies = os.fdopen(os.dup(1), "w")  # the protocol's; fd 1 itself goes to stderr (imports print)
    _REPLIES.append(replies)
    os.dup2(2, 1)
    for name in PRELOAD:
        importlib.import_module(name)
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
        reply = _launch(json.loads(line))
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

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve()
