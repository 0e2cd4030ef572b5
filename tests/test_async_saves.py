"""Saves off the critical path (training/saving.py): the snapshot and the background writer alone (fast), then whole
runs killed while a save is written and while it commits, and preempted while a slow disk writes one: each resumes
from the newest complete checkpoint and ends equal, bit for bit, to a run that was never interrupted."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from checkpoint.background_writer import BackgroundWriter, HostSnapshot
from checkpoint.manifest import describe_file, verify_manifest
from checkpoint.saves import newest_checkpoint, read_latest
from tests.conftest import check, launch, read_jsonl
from tests.test_faults import assert_same_run, job_ranks, run_args, start_forked_job, start_job, wait

FAULTY = "tests/workers/faulty_trainer.py"


def test_snapshot_is_a_compact_copy_in_buffers_reused_by_the_next_save():
    flat = torch.arange(12.0)
    state = {"w": flat[4:8], "moments": [flat[:2], (flat[2:4], 3)], "step": 7, "name": "adam"}
    snapshot = HostSnapshot()
    first = snapshot.copy(state, ("file",))
    flat.add_(100.0)  # the next training step, in place
    assert torch.equal(first["w"], torch.arange(4.0, 8.0)) and torch.equal(
        first["moments"][1][0], torch.tensor([2.0, 3.0])
    )
    assert first["moments"][1][1] == 3 and first["step"] == 7 and first["name"] == "adam"
    assert first["w"].untyped_storage().nbytes() == 4 * 4  # not the view's whole storage (12 floats)
    second = snapshot.copy(state, ("file",))
    assert second["w"].data_ptr() == first["w"].data_ptr()  # the same host buffer, refilled
    assert torch.equal(second["w"], torch.arange(104.0, 108.0))
    snapshot.ready()  # nothing to wait for on the CPU

    class Scaler:  # DeepSpeed's dynamic loss scaler: a plain object the next steps change
        cur_scale = 2.0**16

    scaler = Scaler()
    copied = snapshot.copy({"loss_scaler": scaler}, ("optim",))
    scaler.cur_scale = 2.0**15
    assert copied["loss_scaler"].cur_scale == 2.0**16


def test_gpu_buffers_in_pages_of_their_own_registered_once_and_unregistered_when_freed(monkeypatch):
    """`pinned_empty` (the snapshot's buffers for GPU tensors) against a stand-in for CUDA's runtime (CI has no GPU;
    the real one: tests/test_gpu.py): zeroed tensors of any shape and dtype in their own pages, registered once and
    unregistered when freed; a refusal raises naming the call (the driver's error would otherwise surface at the
    next kernel launch)."""
    import gc
    import mmap

    from checkpoint.background_writer import pinned_empty

    calls = []

    class Runtime:
        refuse = False

        def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - CUDA's names
            calls.append(("register", ptr, nbytes, flags))
            return 1 if self.refuse else 0

        def cudaHostUnregister(self, ptr):  # noqa: N802
            calls.append(("unregister", ptr))
            return 0

        def cudaGetErrorString(self, code):  # noqa: N802
            return "invalid argument"

    runtime = Runtime()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: runtime)
    for shape, dtype in (((3, 5), torch.bfloat16), ((), torch.float32), ((7,), torch.bool), ((0, 4), torch.float32)):
        t = pinned_empty(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        assert calls == ([("register", ptr, nbytes, 1)] if nbytes else [])
        assert nbytes == 0 or ptr % mmap.PAGESIZE == 0  # a mapping of its own
        del t
        gc.collect()
        assert calls[1:] == ([("unregister", ptr)] if nbytes else [])
        calls.clear()
    runtime.refuse = True
    with pytest.raises(RuntimeError, match="cudaHostRegister of a 64-byte checkpoint buffer failed: invalid argument"):
        pinned_empty((16,), torch.float32)


def test_writer_describes_what_it_wrote_and_names_the_file_it_could_not_write(tmp_path):
    writer = BackgroundWriter()
    jobs = [(str(tmp_path / f"f{i}.pt"), {"x": torch.full((3,), float(i))}) for i in range(3)]
    writer.write(jobs, describe=True)
    entries, error, seconds = writer.wait()
    assert error is None and seconds >= 0 and writer.done()
    assert entries == {f"f{i}.pt": describe_file(str(tmp_path / f"f{i}.pt")) for i in range(3)}
    assert torch.equal(torch.load(tmp_path / "f2.pt", weights_only=True)["x"], torch.full((3,), 2.0))
    missing = tmp_path / "no-such-dir" / "f.pt"
    writer.write([(str(tmp_path / "ok.pt"), {"x": torch.ones(1)}), (str(missing), {"x": torch.ones(1)})], True)
    entries, error, _ = writer.wait()
    assert list(entries) == ["ok.pt"] and error.startswith(f"{missing}: ") and "\n" not in error


STEPS = 6


@pytest.fixture(scope="module")
def reference(converted, sft_data, tmp_path_factory):
    """The uninterrupted run, saved once at the end (saves change nothing a later step computes)."""
    out = tmp_path_factory.mktemp("async") / "reference"
    check(launch(2, *run_args(converted["gqa"], out, sft_data[0], max_steps=STEPS)))
    return out


# What each kill leaves of step 4: (published, the step the next start resumes from).
KILLS = {"kill_write": (False, 3), "kill_commit": (True, 4), "kill_publish": (False, 4)}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(KILLS))
def test_sigkill_mid_write_or_mid_commit_resumes_bit_identically(fault, reference, converted, sft_data, tmp_path):
    """The whole job SIGKILLed (deterministic hooks in tests/workers/faulty_trainer.py) while rank 0's writer has
    half-written step 4's second file, after step 4's rename and before `latest` moved, or once every rank has
    written step 4 and before rank 0 publishes it. The next `resume=auto` resumes from step 3 (the only complete
    one), from step 4 (complete, newer than `latest`), or from step 4 published at start (every rank's marker)."""
    published, resumed = KILLS[fault]
    out = tmp_path / "run"
    args = run_args(converted["gqa"], out, sft_data[0], max_steps=STEPS, save_steps=1, resume="auto")
    proc = start_job(2, args, tmp_path / "killed.log", env={"FAULT": f"{fault}:step=4"}, script=FAULTY)
    assert wait(proc, 300) != 0
    assert read_latest(str(out)) == "global_step3"
    assert (out / "global_step4").exists() == published
    assert (out / ".saving-global_step4").exists() == (not published)
    assert newest_checkpoint(str(out)) == ("global_step4" if published else "global_step3")
    done = check(launch(2, *args))  # the resume: any launcher (the kill was the real one's)
    assert f"resumed from {out}/global_step{resumed} " in done.stdout + done.stderr
    assert (f"published {out}/global_step4: every rank had written it" in done.stderr) == (fault == "kill_publish")
    assert verify_manifest(str(out / f"global_step{resumed}")) == []  # kept: keep_last_n=0
    assert_same_run(reference, out)
    records = read_jsonl(out / "metrics.jsonl")
    assert all(r["save_seconds"] >= 0 for r in records), records  # every step saved
    assert f"saved step {STEPS}: blocked " in done.stdout + done.stderr
    assert not [n for n in os.listdir(out) if n.startswith(".")]


@pytest.mark.slow
def test_sigterm_while_a_slow_disk_writes_finishes_that_save_and_its_own(reference, converted, sft_data, tmp_path):
    """SIGTERM (preemption) while a save is being written (each file 150 ms slower): the run waits for it, saves
    the step it stopped at, exits 0, and `resume=auto` ends equal to the uninterrupted run."""
    out = tmp_path / "run"
    args = run_args(converted["gqa"], out, sft_data[0], max_steps=STEPS, save_steps=1, resume="auto")
    proc = start_forked_job(2, args, tmp_path / "first.log", env={"FAULT": "slow_write:ms=150"}, script=FAULTY)
    while proc.poll() is None and not (out.exists() and any(n.startswith(".saving-") for n in os.listdir(out))):
        time.sleep(0.01)
    ranks = job_ranks(proc)
    assert len(ranks) == 2, ranks
    for p in ranks:
        p.send_signal(signal.SIGTERM)
    assert wait(proc, 120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    text = (tmp_path / "first.log").read_text()
    stopped = len(read_jsonl(out / "metrics.jsonl"))
    assert stopped < STEPS and f"SIGTERM: stopped after step {stopped} with a checkpoint" in text, text[-3000:]
    assert read_latest(str(out)) == f"global_step{stopped}"
    assert not [n for n in os.listdir(out) if n.startswith(".saving-")]  # the save in flight was committed too
    check(launch(2, *args))
    assert_same_run(reference, out)


@pytest.mark.slow
def test_synchronous_saves_publish_the_same_checkpoints_and_resume(reference, converted, sft_data, tmp_path):
    """`checkpoint.async_save=false` (written and published inside the call): the run saving every 2 steps ends equal
    to the uninterrupted one, every checkpoint it published matches its manifest and no staging is left, and a
    resume from step 4 ends equal too."""
    out = tmp_path / "run"
    args = run_args(
        converted["gqa"], out, sft_data[0], max_steps=STEPS, save_steps=2, **{"checkpoint.async_save": "false"}
    )
    first = check(launch(2, *args))
    assert_same_run(reference, out)
    assert sorted(n for n in os.listdir(out) if n.startswith("global_step")) == [f"global_step{s}" for s in (2, 4, 6)]
    assert all(verify_manifest(str(out / f"global_step{s}")) == [] for s in (2, 4, 6))
    assert not [n for n in os.listdir(out) if n.startswith(".")] and "saved step 4: blocked " in first.stderr
    done = check(launch(2, *args, "resume_from=global_step4"))
    assert f"resumed from {out}/global_step4 " in done.stdout + done.stderr
    assert_same_run(reference, out)
