"""Reliability under faults: SIGKILL during saves, SIGTERM preemption, a rank that dies or hangs,
NaN losses, and a two-node launch on loopback. Exact resume is checked against uninterrupted runs."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from checkpoint.layer_files import load_layer_state
from checkpoint.manifest import verify_manifest
from checkpoint.saves import newest_checkpoint
from tests.conftest import (
    LAUNCHER,
    NODES_RUN,
    REPO,
    check,
    forked,
    free_port,
    launch,
    read_jsonl,
    run_cmd,
    small_run,
    subprocess_env,
)

pytestmark = pytest.mark.slow  # launches the trainer on several ranks


def run_args(ckpt: str, out: Path, train: str, **extra) -> list[str]:
    defaults = {"gradient_accumulation_steps": 2, "learning_rate": 3e-3, "num_stages": 2, "seed": 5}
    return small_run(ckpt, out, train, **{**defaults, **extra})


def start_job(nprocs: int, args: list[str], log: Path, env: dict | None = None, script: str = "trainer.py"):
    """A `deepspeed` launch in its own session, so the whole job can be signalled at once."""
    cmd = [LAUNCHER, "--num_gpus", str(nprocs), "--master_port", str(free_port()), script, *args]
    return start_job_cmd(cmd, log, env)


def start_forked_job(nprocs: int, args: list[str], log: Path, env: dict | None = None, script: str = "trainer.py"):
    """The trainer's ranks forked from the fork server as one process group (tests/zygote.py `Zygote.start`): what a
    SIGKILL of the whole job reaches, as it reaches `start_job`'s, without the launcher's start-up (its two extra
    processes importing torch and DeepSpeed, ranks that import them again). With TEST_LAUNCHER=subprocess:
    `start_job`."""
    zygote = forked()
    if zygote is None:
        return start_job(nprocs, args, log, env, script)
    return zygote.start(script, args, nprocs, env={**subprocess_env(), **(env or {})}, log=str(log), port=free_port())


def job_ranks(proc) -> list[psutil.Process]:
    """The ranks of a job `start_job` (the `deepspeed` launcher's children with `--local_rank`) or `start_forked_job`
    (its supervisor's children) started."""
    children = psutil.Process(proc.pid).children(recursive=isinstance(proc, subprocess.Popen))
    if isinstance(proc, subprocess.Popen):
        children = [p for p in children if any(a.startswith("--local_rank") for a in p.cmdline())]
    return children


def wait(proc, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    finally:
        if hasattr(proc, "log_file"):  # a Popen's (a forked job's ranks write the log themselves)
            proc.log_file.close()


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of every layer file of the newest checkpoint (for LoRA runs: the adapters)."""
    return final_weights_at(out, newest_checkpoint(str(out)))


def final_weights_at(out: Path, tag: str) -> dict[str, torch.Tensor]:
    step_dir = out / tag
    return {f"{f.name}:{k}": v for f in sorted(step_dir.glob("layer_*")) for k, v in load_layer_state(str(f)).items()}


def assert_same_run(reference: Path, other: Path) -> None:
    """Same losses, learning rates and grad norms at every step, and bit-identical final weights."""
    ref, got = read_jsonl(reference / "metrics.jsonl"), read_jsonl(other / "metrics.jsonl")
    assert [m["step"] for m in got] == [m["step"] for m in ref]
    for a, b in zip(ref, got, strict=True):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"]), (a, b)
    a, b = final_weights(reference), final_weights(other)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def newest_on_disk(out: Path) -> str | None:
    """The newest checkpoint judged from the files alone, not by the code under test (`newest_checkpoint`): the
    highest published `global_stepN` directory whose every file matches its manifest."""
    steps = [int(n.removeprefix("global_step")) for n in os.listdir(out) if re.fullmatch(r"global_step\d+", n)]
    whole = [n for n in sorted(steps, reverse=True) if verify_manifest(str(out / f"global_step{n}")) == []]
    return f"global_step{whole[0]}" if whole else None


def written_on_disk(out: Path, after: str | None) -> str | None:
    """The newest save that a kill left unpublished after every rank had written it (newer than `after`), judged
    from the files: its staging directory holds the layout file and each of the layout's ranks' markers. The next
    start publishes it (checkpoint/saves.py `written_saves`)."""
    step = int(after.removeprefix("global_step")) if after else -1
    found = []
    for name in os.listdir(out):
        m = re.fullmatch(r"\.saving-global_step(\d+)", name)
        if not m or int(m.group(1)) <= step or not (out / name / "layout.json").exists():
            continue
        layout = json.loads((out / name / "layout.json").read_text())
        ranks = layout["num_stages"] * layout["dp_size"] * layout["tp_size"] * layout["context_parallel_size"]
        if all((out / name / f".written-rank{r}.json").exists() for r in range(ranks)):
            found.append(int(m.group(1)))
    return f"global_step{max(found)}" if found else None


def saving_after(out: Path, step: int) -> bool:
    """Whether a save of a step after `step` is under way (`.saving-global_stepN`, N > step)."""
    if not out.exists():
        return False
    prefix = ".saving-global_step"
    return any(n.startswith(prefix) and int(n.removeprefix(prefix)) > step for n in os.listdir(out))


def test_sigkill_during_saves_then_resume_auto(converted, sft_data, tmp_path):
    """N times (SIGKILL_TRIALS, 8 in CI; 20 in docs/measured.md): SIGKILL the whole job at a random
    moment of a save; the next `resume=auto` launch loads the newest complete checkpoint (manifest intact), or the
    newer save every rank had finished writing (published at start), and continues. The run pieced together
    from N + 1 launches equals an uninterrupted one, bit for bit. Each launch
    is killed within a step or two of resuming, so 5 steps per trial leave every kill room to land. The jobs' ranks
    are forked as one process group (`start_forked_job`); the deterministic kills of tests/test_async_saves.py
    kill jobs of the real launcher."""
    trials = int(os.environ.get("SIGKILL_TRIALS", "8"))
    steps = 5 * trials
    args = dict(max_steps=steps, save_steps=1, keep_last_n=2, resume="auto")
    reference = tmp_path / "reference"  # saved once, at the end: saves change nothing a later step computes
    check(launch(2, *run_args(converted["gqa"], reference, sft_data[0], **{**args, "save_steps": 0})))

    out, rng, rolled = tmp_path / "killed", random.Random(0), 0
    kills, mid_save, resumed_from, deadline = 0, 0, [], time.monotonic() + 900
    while kills < trials and time.monotonic() < deadline:
        expected = newest_on_disk(out) if out.exists() else None
        assert expected == (newest_checkpoint(str(out)) if out.exists() else None)
        expected = (written_on_disk(out, expected) if out.exists() else None) or expected  # published at start
        log = tmp_path / f"launch{kills}.log"
        proc = start_forked_job(2, run_args(converted["gqa"], out, sft_data[0], **args), log)
        # A fresh launch is killed only after its first save is complete: that save is the slowest of a process
        # (about 0.2 s here), and a kill inside it leaves the next launch fresh again, and so on for every launch.
        done = int(expected.removeprefix("global_step")) if expected else 1
        # Wait for this launch to have resumed (it removed what the last kill left), then for its next save.
        while proc.poll() is None and not ("resumed from" in log.read_text() or "starting fresh" in log.read_text()):
            time.sleep(0.05)
        # Every other launch first lets one save be published: on a loaded machine a save can outlast the random
        # delay below every time, and each kill inside the first save would resume from the same step again (a full
        # suite run saw resumes from steps 3 and 4 only).
        while kills % 2 == 0 and proc.poll() is None and not (out / f"global_step{done + 1}").exists():
            time.sleep(0.005)
        while proc.poll() is None and not saving_after(out, done + (kills % 2 == 0)):
            time.sleep(0.005)
        # Somewhere in the save, the rename, `latest`, retention (half the trials) or up to a step later.
        time.sleep(rng.uniform(0.0, 0.05 if kills % 2 else 0.25))
        if proc.poll() is not None:  # finished training, or failed, before a kill
            wait(proc, 30)
            pytest.fail(f"launch {kills} exited {proc.returncode} before a kill:\n{log.read_text()[-3000:]}")
        os.killpg(proc.pid, signal.SIGKILL)
        wait(proc, 30)
        kills += 1
        rolled += "every rank had written it" in log.read_text()
        mid_save += any(n.startswith((".saving-", ".deleting-")) for n in os.listdir(out))
        text = log.read_text()
        if expected:
            assert f"resumed from {out}/{expected} " in text, text[-3000:]
            resumed_from.append(int(expected.removeprefix("global_step")))
        else:
            assert "starting fresh" in text, text[-3000:]
        newest = newest_on_disk(out)
        assert newest == newest_checkpoint(str(out)), (newest, os.listdir(out))
    assert kills == trials, f"only {kills} kills in the time allowed"
    assert len(set(resumed_from)) > trials // 4, resumed_from  # the kills landed at many different steps
    proc = start_forked_job(2, run_args(converted["gqa"], out, sft_data[0], **args), tmp_path / "last.log")
    assert wait(proc, 300) == 0, (tmp_path / "last.log").read_text()[-3000:]
    assert_same_run(reference, out)
    assert len([n for n in os.listdir(out) if n.startswith("global_step")]) == 2  # keep_last_n=2
    assert not [n for n in os.listdir(out) if n.startswith(".")]
    assert mid_save >= trials // 4, mid_save  # many kills landed inside a save or a retention delete
    print(
        f"SIGKILL: {kills} kills survived ({mid_save} inside a save, {rolled} saves published at the next start), "
        f"resumed from {sorted(set(resumed_from))}"
    )


def test_sigterm_saves_at_step_boundary_and_exits_zero(converted, sft_data, tmp_path):
    """SIGTERM to the ranks (as a scheduler does before preemption): checkpoint at the end of the step,
    exit 0; `resume=auto` continues exactly, LoRA dropout RNG state included."""
    lora = {"lora.enabled": "true", "lora.dropout": 0.1, "lora.r": 4, "lora.alpha": 8, "max_steps": 8}
    reference = tmp_path / "reference"
    check(launch(2, *run_args(converted["gqa"], reference, sft_data[0], **lora)))

    out = tmp_path / "preempted"
    args = run_args(converted["gqa"], out, sft_data[0], resume="auto", **lora)
    proc = start_forked_job(2, args, tmp_path / "first.log")
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.exists() and len(read_jsonl(metrics)) >= 3):
        time.sleep(0.05)
    ranks = job_ranks(proc)
    assert len(ranks) == 2, ranks
    for p in ranks:
        p.send_signal(signal.SIGTERM)
    assert wait(proc, 120) == 0, (tmp_path / "first.log").read_text()[-3000:]
    text = (tmp_path / "first.log").read_text()
    stopped = len(read_jsonl(metrics))
    assert 3 <= stopped < 8 and f"SIGTERM: stopped after step {stopped} with a checkpoint" in text, text[-3000:]
    assert (out / "latest").read_text() == f"global_step{stopped}"
    check(launch(2, *args))
    assert_same_run(reference, out)


def test_a_forked_job_is_one_process_group_with_its_ranks_exit_code(tmp_path):
    """What the fault tests' forked jobs promise (`start_forked_job`): the job's exit code as torchrun gives it (0, or
    1 when a rank fails), its ranks found, and a SIGKILL of its process group reaching every rank at once."""
    if forked() is None:
        pytest.skip("TEST_LAUNCHER=subprocess: start_forked_job is start_job")
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "if sys.argv[1] == 'sleep':\n    time.sleep(300)\n"
        "sys.exit(3 if sys.argv[1] == 'fail' and os.environ['RANK'] == '1' else 0)\n"
    )
    for how, code in (("pass", 0), ("fail", 1)):
        assert wait(start_forked_job(2, [how], tmp_path / f"{how}.log", script=str(script)), 60) == code
    proc = start_forked_job(2, ["sleep"], tmp_path / "sleep.log", script=str(script))
    deadline = time.monotonic() + 30
    while len(ranks := job_ranks(proc)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ranks) == 2 and proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert wait(proc, 30) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while (alive := [p for p in ranks if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive


def running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # killed, and its new parent has not reaped it yet
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("fault,expect", [("raise", "injected fault on rank 2"), ("hang", "no answer from another")])
def test_a_failed_or_hung_rank_stops_every_rank(fault, expect, converted, sft_data, tmp_path):
    """4 ranks (PP=2 x DP=2); rank 2 raises (or stops responding) in the middle of step 3: every rank
    exits with a message naming its rank and the step within the configured timeout, no hang."""
    timeout_minutes = 0.25
    args = run_args(
        converted["gqa"], tmp_path / "run", sft_data[0], max_steps=6, save_steps=2, dist_timeout_minutes=timeout_minutes
    )
    start = time.monotonic()
    proc = start_job(
        4, args, tmp_path / "job.log", env={"FAULT": f"{fault}:rank=2,step=3"}, script="tests/workers/faulty_trainer.py"
    )
    code = wait(proc, 240)
    elapsed = time.monotonic() - start
    text = (tmp_path / "job.log").read_text()
    assert code != 0
    # One line per rank, as docs/reliability_and_security.md says: the failing rank names its error, the others
    # "lost contact" (it died) or "no answer" (it hung, and is killed by the launcher without a line).
    errors = [line for line in text.splitlines() if line.startswith("trainer: error: rank ")]
    others = "lost contact with another rank" if fault == "raise" else "no answer from another rank"
    for rank in (0, 1, 3):
        mine = [line for line in errors if line.startswith(f"trainer: error: rank {rank}: step 3 failed: ")]
        assert len(mine) == 1 and others in mine[0], (rank, errors, text[-4000:])
    if fault == "raise":
        assert [line for line in errors if "rank 2:" in line and expect in line], errors
    assert (tmp_path / "run" / "latest").read_text() == "global_step2"
    # bounded: start-up + timeout + the launcher's 30 s grace before SIGKILL of a hung rank
    assert elapsed < 60 + timeout_minutes * 60 + 35, elapsed
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    print(f"{fault}: all ranks gone {elapsed:.0f} s after launch")


def test_nan_loss_stops_and_keeps_last_checkpoint(converted, sft_data, tmp_path):
    out = tmp_path / "run"
    args = run_args(converted["gqa"], out, sft_data[0], num_stages=1, max_steps=4, save_steps=2)
    env = {"FAULT": "nan:step=3", "FAULT_MICRO_BATCHES": "2"}
    proc = run_cmd([sys.executable, "tests/workers/faulty_trainer.py", *args], timeout=300, env=env)
    assert proc.returncode != 0
    assert "loss is nan at step 3; stopped without saving (last checkpoint: global_step2)" in proc.stderr
    assert (out / "latest").read_text() == "global_step2" and not (out / "global_step3").exists()
    assert verify_manifest(str(out / "global_step2")) == []

    # nonfinite_loss=skip: step 3's update is skipped (weights unchanged), training goes on.
    skip = tmp_path / "skip"
    args = run_args(converted["gqa"], skip, sft_data[0], num_stages=1, max_steps=4, save_steps=1, nonfinite_loss="skip")
    proc = run_cmd([sys.executable, "tests/workers/faulty_trainer.py", *args], timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss is nan at step 3: update skipped" in proc.stderr
    losses = [m["loss"] for m in read_jsonl(skip / "metrics.jsonl")]
    assert len(losses) == 4 and losses[2] != losses[2] and all(x == x for x in losses[:2] + losses[3:])
    step = {n: final_weights_at(skip, f"global_step{n}") for n in (2, 3, 4)}
    assert all(torch.equal(step[2][k], step[3][k]) for k in step[2])  # the NaN step changed nothing
    assert not all(torch.equal(step[3][k], step[4][k]) for k in step[3])  # the next one trained


def test_two_node_launch_on_loopback(converted, sft_data, single_node_run, tmp_path):
    """Two `torchrun --nnodes 2` launchers with 2 ranks each on 127.0.0.1: PP=2 x DP=2 trains and saves,
    and matches the same run launched as one node of 4 ranks."""
    out, port = tmp_path / "two_nodes", free_port()
    args = small_run(converted["gqa"], out, sft_data[0], **NODES_RUN)
    procs = []
    for node in range(2):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}"]
        cmd = [*launcher, "--nproc_per_node=2", "--master_addr=127.0.0.1", f"--master_port={port}", "trainer.py", *args]
        procs.append(start_job_cmd(cmd, tmp_path / f"node{node}.log"))
    codes = [wait(p, 300) for p in procs]
    assert codes == [0, 0], [(tmp_path / f"node{n}.log").read_text()[-2000:] for n in range(2)]
    assert (out / "latest").read_text() == "global_step3" and verify_manifest(str(out / "global_step3")) == []
    assert_same_run(single_node_run, out)


def start_job_cmd(cmd: list[str], log: Path, env: dict | None = None):
    """Any launch command in its own session, output to `log`."""
    out = open(log, "w")
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**subprocess_env(), **(env or {})},
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proc.log_file = out
    return proc
