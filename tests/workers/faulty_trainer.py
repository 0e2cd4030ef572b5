"""Worker: `trainer.py` with one fault injected, for the fault and bad-input tests.

    FAULT=KIND[:key=value,...] deepspeed --num_gpus N tests/workers/faulty_trainer.py OVERRIDES...

Kinds (the trainer code itself is unchanged; the fault is patched in from outside):
    enospc:step=S          every torch.save into the checkpoint of step S fails with ENOSPC (disk full)
    raise:rank=R,step=S    rank R raises in the middle of step S (second micro-batch forward)
    hang:rank=R,step=S     rank R stops responding in the middle of step S
    nan:step=S             the loss of step S is NaN
    kill_write:step=S      the whole job is SIGKILLed while rank 0's background writer writes step S's second file
    kill_commit:step=S     the whole job is SIGKILLed while step S commits: renamed, `latest` not yet moved
    kill_publish:step=S    the whole job is SIGKILLed once every rank has written step S, before rank 0 publishes it
    slow_write:ms=M        each file of a save takes M ms more to write (a slow disk), for SIGTERM mid-write
    hold_rendezvous:rank=R rank 0 writes $HOOK_DIR/hosting once it hosts the store; rank R waits for $HOOK_DIR/go
                           before it joins; after the rendezvous rank 0 writes $HOOK_DIR/joined and waits for
                           $HOOK_DIR/go2 (another job can then try the port mid-rendezvous and mid-run)
"""

import errno
import os
import runpy
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
kind, _, spec = os.environ["FAULT"].partition(":")
opts = {k: int(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)}

if kind == "enospc":
    _save = torch.save

    def full_disk_save(obj, f, *args, **kwargs):
        path = getattr(f, "path", f)  # a path, or the file object the background writer saves through
        if isinstance(path, str | os.PathLike) and f"global_step{opts['step']}" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return _save(obj, f, *args, **kwargs)

    torch.save = full_disk_save

elif kind in ("raise", "hang"):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    _forward = PipelineEngine._exec_forward_pass
    calls = {"n": 0}

    def faulty_forward(self, buffer_id):
        if int(os.environ["RANK"]) == opts["rank"] and self.global_steps == opts["step"] - 1:
            calls["n"] += 1
            if calls["n"] == 2:
                if kind == "raise":
                    raise RuntimeError(f"injected fault on rank {opts['rank']}")
                time.sleep(3600)
        return _forward(self, buffer_id)

    from deepspeed.runtime.pipe import schedule

    PipelineEngine._INSTRUCTION_MAP[schedule.ForwardPass] = faulty_forward  # the engine dispatches through it

elif kind == "nan":
    from models.loss import CausalLMLoss

    _call = CausalLMLoss.__call__
    seen = {"n": 0}

    def nan_loss(self, logits, labels):
        loss = _call(self, logits, labels)
        seen["n"] += 1
        micro = int(os.environ.get("FAULT_MICRO_BATCHES", "1"))
        return loss * float("nan") if (seen["n"] - 1) // micro == opts["step"] - 1 else loss

    CausalLMLoss.__call__ = nan_loss

elif kind in ("kill_write", "kill_commit", "kill_publish", "slow_write"):
    import signal

    from checkpoint import background_writer, saves

    def kill_job():
        os.killpg(os.getpgid(0), signal.SIGKILL)  # the launcher and every rank, as a node failure would

    if kind == "kill_write":
        _write, written = background_writer.write_durably, {"n": 0}

        def dying_write(path, state):
            if int(os.environ["RANK"]) == 0 and f"global_step{opts['step']}/" in path:
                written["n"] += 1
                if written["n"] == 2:
                    with open(path, "wb") as f:
                        f.write(b"half a file")
                    kill_job()
            return _write(path, state)

        background_writer.write_durably = dying_write
    elif kind == "kill_commit":
        _latest = saves.write_text_atomic

        def dying_latest(path, text):
            if text == f"global_step{opts['step']}":
                kill_job()
            _latest(path, text)

        saves.write_text_atomic = dying_latest
    elif kind == "kill_publish":
        from training import saving

        _publish = saving.publish

        def dying_publish(staging, tag, world, cfg):
            if tag == f"global_step{opts['step']}":
                kill_job()
            _publish(staging, tag, world, cfg)

        saving.publish = dying_publish
    else:
        _write = background_writer.write_durably

        def slow_write(path, state):
            time.sleep(opts["ms"] / 1000)
            return _write(path, state)

        background_writer.write_durably = slow_write

elif kind == "hold_rendezvous":
    from training import assembly, rendezvous

    hook_dir, rank = os.environ["HOOK_DIR"], int(os.environ["RANK"])

    def wait_for(name: str) -> None:
        while not os.path.exists(os.path.join(hook_dir, name)):
            time.sleep(0.05)

    def touch(name: str) -> None:
        open(os.path.join(hook_dir, name), "w").close()

    _open, _init = rendezvous._open_store, assembly.init_distributed

    def held_open(rank_, *args):
        if rank_ == opts["rank"]:
            wait_for("go")
        store = _open(rank_, *args)
        if rank_ == 0:
            touch("hosting")
        return store

    def held_init(*args):
        result = _init(*args)
        if rank == 0:
            touch("joined")
            wait_for("go2")
        return result

    rendezvous._open_store, assembly.init_distributed = held_open, held_init

else:
    raise SystemExit(f"faulty_trainer: unknown FAULT kind {kind!r}")

sys.argv[0] = os.path.join(REPO, "trainer.py")
runpy.run_path(sys.argv[0], run_name="__main__")
