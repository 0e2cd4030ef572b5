"""Where a rank learns its place in the job: a launcher (`deepspeed`, `torchrun`: RANK and WORLD_SIZE), SLURM's
`srun` (its task variables), or nothing (`python trainer.py`: a world of one).

`srun python trainer.py ...` starts one task per rank and sets no RANK/WORLD_SIZE: the rank is SLURM_PROCID, the
world SLURM_NTASKS, the local rank SLURM_LOCALID and the master the first host of the step's nodes
(SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST, through `scontrol show hostnames`, or read directly where a
container has no scontrol); MASTER_PORT is kept when the job exports one, else derived from the job id so every
task picks the same. Only inside an `srun` step of several tasks (SLURM_STEP_ID set): the batch script itself
also carries SLURM_PROCID=0 and SLURM_NTASKS, and a trainer started there without `srun`, or in a one-task step,
is alone (127.0.0.1 and a free port, as `python trainer.py`).
"""

from __future__ import annotations

import os
import re
import subprocess


def slurm_step(environ) -> bool:
    """Whether this process is a task of an `srun` step of several tasks (not the batch script, not a launcher's
    child, not a one-task step such as `srun --pty bash`)."""
    steps = "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ
    return steps and environ.get("SLURM_NTASKS", "1") != "1"


def tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Tasks of the step on node `node`, from SLURM_STEP_TASKS_PER_NODE ("4(x2),3" -> 4, 4, 3)."""
    counts = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}: not SLURM's form")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[node]


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list ("gpu[003-004,007]" -> "gpu003"), as `scontrol show hostnames` says;
    read directly where scontrol is missing or fails (a container without SLURM's config)."""
    if not nodelist:
        raise ValueError("an srun task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: export MASTER_ADDR")
    if not re.search(r"[\[,]", nodelist):
        return nodelist
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    m = re.match(r"([^\[,]+)(?:\[(\d+)[^\]]*\])?(?:,|$)", nodelist)  # a plain `prefix[a-b,c],...` list
    if m is None:
        raise ValueError(f"SLURM node list {nodelist}: scontrol show hostnames cannot expand it; export MASTER_ADDR")
    return m[1] + (m[2] or "")


def step_nodes(environ) -> str:
    """The nodes of this srun step (SLURM_STEP_NODELIST), else of the job."""
    return environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")


def slurm_environment(environ) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT of an `srun` task."""
    env = {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(step_nodes(environ)),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(20000 + int(environ.get("SLURM_JOB_ID", "0")) % 20000),
    }
    if "SLURM_STEP_TASKS_PER_NODE" in environ:
        per_node = tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], int(environ.get("SLURM_NODEID", "0")))
        env["LOCAL_WORLD_SIZE"] = str(per_node)
    return env


def resolve_launch(environ=os.environ) -> str:
    """Fill in what a rank needs to join its process group (in `environ`); returns where it came from, for the
    first log line. Raises ValueError (one line) for a SLURM environment it cannot read."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return f"ranks from the launcher (RANK/WORLD_SIZE): world size {environ['WORLD_SIZE']}"
    if slurm_step(environ):
        environ.update(slurm_environment(environ))
        return (
            f"ranks from SLURM (srun step {environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}): world size "
            f"{environ['WORLD_SIZE']} = SLURM_NTASKS, rank = SLURM_PROCID, master {environ['MASTER_ADDR']}:"
            f"{environ['MASTER_PORT']}"
        )
    environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    if "SLURM_NTASKS" in environ and environ["SLURM_NTASKS"] != "1":
        return (
            f"a world of one: SLURM_NTASKS={environ['SLURM_NTASKS']} but this is not an srun task (start the "
            "trainer with srun, or with deepspeed --launcher slurm)"
        )
    return "a world of one (no launcher)"
