"""SLURM for real: `srun python trainer.py` and `sbatch examples/slurm/train.sbatch` on a slurmctld and a slurmd of
the test's own (Debian's slurm-wlm and munge, installed when missing), on this machine as one node.

The ranks of an `srun` step read their place from SLURM's variables (training/launch_env.py): PP=2 x DP=2 through
`srun -n 4` equals the deepspeed launcher's run bit for bit. A batch job stopped twice, once by
`scancel --signal=TERM` (the tasks save and exit 0; `scontrol requeue` starts it again) and once by the USR1 the
sbatch file asks for before its time limit (it stops the ranks and requeues itself), runs every step once and ends
with an uninterrupted run's losses and weights. Root only (packages, daemons); anywhere else it says so and skips.
SLURM holds a requeued job until its old credentials expire (`cred_expire`, 120 s by default; 5 s here): a job
started again sooner is killed as "Job credential revoked".
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import NODES_RUN, REPO, ensure_packages, free_port, read_jsonl, small_run, subprocess_env
from tests.test_faults import assert_same_run

pytestmark = pytest.mark.slow

PACKAGES = {
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/bin/srun": "slurm-client",
    "/usr/sbin/munged": "munge",
}
PREEMPTED_RUN = {**NODES_RUN, "max_steps": 64}  # room for two stops however late a signal lands


class Slurm:
    """A one-node cluster: munged, slurmctld and slurmd under `root`, their config in SLURM_CONF."""

    def __init__(self, root: Path):
        self.root = root
        for name in ("run", "state", "spool", "log"):
            (root / name).mkdir(parents=True)
        node = socket.gethostname().split(".")[0]
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self.conf = root / "slurm.conf"
        self.conf.write_text(
            f"ClusterName=tests\nSlurmctldHost={node}(127.0.0.1)\nSlurmctldPort={free_port()}\n"
            f"SlurmdPort={free_port()}\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
            f"AuthInfo=socket={root / 'run' / 'munge.sock'},cred_expire=5\nStateSaveLocation={root / 'state'}\n"
            f"SlurmdSpoolDir={root / 'spool'}\nSlurmctldPidFile={root / 'run' / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}\nSlurmctldLogFile={root / 'log' / 'slurmctld.log'}\n"
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSchedulerType=sched/builtin\n"
            "JobRequeue=1\nReturnToService=2\nMpiDefault=none\nSlurmdParameters=config_overrides\n"
            f"NodeName={node} NodeAddr=127.0.0.1 CPUs=8 RealMemory=8000 State=UNKNOWN\n"
            f"PartitionName=tests Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n"
        )
        self.env = {**subprocess_env(), "SLURM_CONF": str(self.conf)}
        run = root / "run"
        self.daemons = [
            [
                "/usr/sbin/munged",
                "--force",
                f"--socket={run / 'munge.sock'}",
                f"--pid-file={run / 'munged.pid'}",
                f"--log-file={root / 'log' / 'munged.log'}",
                f"--key-file={key}",
                f"--seed-file={run / 'munge.seed'}",
            ],
            ["/usr/sbin/slurmctld", "-f", str(self.conf)],
            ["/usr/sbin/slurmd", "-f", str(self.conf), "-N", node],
        ]
        for cmd in self.daemons:  # each daemonizes and writes its pid file
            subprocess.run(cmd, env=self.env, check=True, capture_output=True, timeout=60)
        deadline = time.time() + 60
        while self.run(["sinfo", "-h", "-o", "%T"]).stdout.strip() != "idle":
            assert time.time() < deadline, self.logs()
            time.sleep(0.5)

    def run(self, cmd: list[str], timeout: int = 600, **env) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=REPO, env={**self.env, **env}, capture_output=True, text=True, timeout=timeout)

    def job(self, job_id: str) -> dict:
        out = self.run(["scontrol", "show", "job", job_id]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_state(self, job_id: str, states: tuple[str, ...], timeout: float = 300) -> str:
        deadline = time.time() + timeout
        while (state := self.job(job_id).get("JobState")) not in states:
            assert time.time() < deadline, f"job {job_id} is {state}, not {states}\n{self.logs()}"
            time.sleep(0.2)
        return state

    def release(self, job_id: str) -> None:
        """Start a requeued job as soon as its old credentials have expired (cred_expire=5), not at the
        scheduler's next periodic pass."""
        self.wait_state(job_id, ("PENDING", "CONFIGURING", "RUNNING"))
        time.sleep(6)
        self.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])

    def logs(self) -> str:
        return "\n".join(p.read_text()[-1500:] for p in sorted((self.root / "log").glob("*.log")))

    def stop(self) -> None:
        self.run(["scancel", "--full", "--signal=KILL", "--user=root"])
        for name in ("slurmd", "slurmctld", "munged"):
            pid_file = self.root / "run" / f"{name}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


@pytest.fixture
def slurm(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root: installs slurm-wlm and munge from Debian's packages and runs their daemons")
    ensure_packages(PACKAGES)
    cluster = Slurm(tmp_path / "slurm")
    try:
        yield cluster
    finally:
        cluster.stop()


def srun_trainer(slurm: Slurm, out: Path, converted, sft_data, run: dict) -> subprocess.CompletedProcess:
    cmd = [
        "srun",
        "-n",
        "4",
        "--cpus-per-task=1",
        sys.executable,
        "trainer.py",
        *small_run(converted["gqa"], out, sft_data[0], **run),
    ]
    proc = slurm.run(cmd, MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm.logs()
    return proc


def test_srun_launch_equals_the_deepspeed_launcher(slurm, converted, sft_data, single_node_run, tmp_path):
    out = tmp_path / "srun"
    proc = srun_trainer(slurm, out, converted, sft_data, NODES_RUN)
    assert "ranks from SLURM (srun step" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    a, b = read_jsonl(single_node_run / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [(m["loss"], m["grad_norm"], m["lr"]) for m in a] == [(m["loss"], m["grad_norm"], m["lr"]) for m in b]
    print(f"srun -n 4: losses {[m['loss'] for m in b]} equal the deepspeed launcher's", file=sys.stderr)


def test_requeued_batch_job_runs_every_step_once(slurm, converted, sft_data, tmp_path):
    reference = tmp_path / "uninterrupted"
    srun_trainer(slurm, reference, converted, sft_data, PREEMPTED_RUN)
    out = tmp_path / "job"
    metrics, log = out / "metrics.jsonl", tmp_path / "job.log"

    def steps() -> int:
        return len(read_jsonl(metrics)) if metrics.exists() else 0

    def after(done: int, job_id: str) -> None:
        deadline = time.time() + 300
        while steps() < done + 2:
            assert time.time() < deadline and slurm.job(job_id).get("JobState") in (
                "PENDING",
                "CONFIGURING",
                "RUNNING",
            ), log.read_text()[-3000:] if log.exists() else slurm.logs()
            time.sleep(0.25)  # each check runs scontrol, which asks slurmctld: not every 50 ms

    sbatch = [
        "sbatch",
        "--parsable",
        "--nodes=1",
        "--ntasks-per-node=4",
        "--gpus-per-node=0",
        "--cpus-per-task=1",
        "--time=30",
        f"--output={log}",
        "examples/slurm/train.sbatch",
        *small_run(converted["gqa"], out, sft_data[0], **PREEMPTED_RUN),
    ]
    proc = slurm.run(sbatch, MASTER_PORT=str(free_port()))
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    after(0, job_id)
    # 1. The scheduler's preemption signal (scancel --signal=TERM reaches every task): save, exit 0, job done.
    slurm.run(["scancel", "--signal=TERM", job_id])
    assert slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", log.read_text()[-3000:]
    first = steps()
    assert 2 <= first < PREEMPTED_RUN["max_steps"] and (out / "latest").read_text() == f"global_step{first}"
    # 2. Requeued by hand: resume=auto continues from that checkpoint.
    assert slurm.run(["scontrol", "requeue", job_id]).returncode == 0
    slurm.release(job_id)
    after(first, job_id)
    # 3. The time limit near, signalled by SLURM itself: the job's limit is cut to what it has run plus 4-5 minutes,
    # so slurmctld sends the file's `--signal=B:USR1@300` to the batch script at its next time-limit check (every
    # 30 s). The ranks are held (SIGSTOP) until the script has it, or the 64 small steps would end first; the trap
    # stops them (they save at the next step) and requeues the job. The limit is 30 minutes again for the third launch.
    ranks = [
        p
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [])[1:2] == ["trainer.py"] and f"output_dir={out}" in p.info["cmdline"]  # not srun
    ]
    assert len(ranks) == 4, ranks
    for p in ranks:
        p.suspend()
    ran = sum(int(x) * 60**i for i, x in enumerate(reversed(slurm.job(job_id)["RunTime"].split(":"))))
    assert slurm.run(["scontrol", "update", f"jobid={job_id}", f"TimeLimit={(ran + 300) // 60}"]).returncode == 0
    deadline = time.time() + 120
    while "train.sbatch: time limit near" not in log.read_text():
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    for p in ranks:
        p.resume()
    deadline = time.time() + 300
    while int(slurm.job(job_id).get("Restarts", 0)) < 2:
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    second = steps()
    assert slurm.run(["scontrol", "update", f"jobid={job_id}", "TimeLimit=30"]).returncode == 0
    slurm.release(job_id)
    assert slurm.wait_state(job_id, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", log.read_text()[-3000:]
    text = log.read_text()
    assert first < second < PREEMPTED_RUN["max_steps"] and "requeueing job" in text, text[-3000:]
    assert len(re.findall(r"\[rank0\].*ranks from SLURM \(srun step", text)) == 3, text[-3000:]  # three launches
    assert_same_run(reference, out)  # every step once, the uninterrupted losses, bit-identical weights
    print(f"batch job stopped after steps {first} and {second}, requeued twice: the uninterrupted run", file=sys.stderr)
