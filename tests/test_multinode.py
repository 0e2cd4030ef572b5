"""`deepspeed --hostfile` for real: two "nodes" on loopback addresses reached over ssh by DeepSpeed's pdsh runner.

The multi-node launch of docs/training.md runs `pdsh` over `ssh` to every host of the hostfile. Here the hosts are
127.0.0.1 and 127.0.0.2 (2 ranks each, PP=2 x DP=2), served by an sshd of our own on a free port with keys made
for the test, installed from Debian's packages (openssh-server, pdsh) when they are missing. It needs root
(packages, sshd, root's own login); anywhere else it says so and skips. The losses must equal a single-node
launch's bit for bit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import (
    LAUNCHER,
    NODES_RUN,
    REPO,
    ensure_packages,
    free_port,
    read_jsonl,
    small_run,
    subprocess_env,
)

pytestmark = pytest.mark.slow

PACKAGES = {"/usr/sbin/sshd": "openssh-server", "/usr/bin/pdsh": "pdsh"}


@pytest.fixture
def loopback_sshd(tmp_path):
    """An sshd on 127.0.0.1 and 127.0.0.2 that lets root in with a key made for the test. Yields the ssh options."""
    if os.geteuid() != 0:
        pytest.skip("needs root: installs sshd and pdsh from Debian's packages and logs in as root over loopback")
    ensure_packages(PACKAGES)
    keys = tmp_path / "ssh"
    keys.mkdir(mode=0o700)
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / name)], check=True)
    shutil.copy(keys / "user.pub", keys / "authorized_keys")
    port = free_port()
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nListenAddress 127.0.0.2\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"StrictModes no\nUsePAM no\nPidFile {keys / 'sshd.pid'}\n"
    )
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(keys / "sshd.log")])
    options = f"-i {keys / 'user'} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR"
    try:
        for host in ("127.0.0.1", "127.0.0.2"):  # wait until both addresses answer
            for _ in range(100):
                probe = subprocess.run(
                    ["ssh", *options.split(), "-p", str(port), f"root@{host}", "true"], capture_output=True, timeout=30
                )
                if probe.returncode == 0:
                    break
                time.sleep(0.1)
            assert probe.returncode == 0, (keys / "sshd.log").read_text()[-2000:]
        yield port, options
    finally:
        sshd.terminate()
        sshd.wait(30)


def test_hostfile_launch_over_ssh_equals_a_single_node_run(
    loopback_sshd, converted, sft_data, single_node_run, tmp_path
):
    port, options = loopback_sshd

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    env_file = tmp_path / "ds_env"  # exported on every node (PYTHONPATH is exported by DeepSpeed itself)
    env_file.write_text("OMP_NUM_THREADS=1\nTOKENIZERS_PARALLELISM=false\n")
    env = {**subprocess_env(), "PDSH_SSH_ARGS_APPEND": options, "DS_ENV_FILE": str(env_file)}
    two = tmp_path / "two_nodes"
    # NOTE: --no_ssh_check: the launcher's own probe runs plain `ssh HOST` (root's ~/.ssh, which the test leaves
    # alone); the fixture has already logged in to both hosts with the test's key, as pdsh then does.
    cmd = [
        LAUNCHER,
        "--hostfile",
        str(hostfile),
        "--launcher",
        "pdsh",
        "--no_ssh_check",
        "--ssh_port",
        str(port),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "trainer.py",
        *small_run(converted["gqa"], two, sft_data[0], **NODES_RUN),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()  # pdsh prefixes every line with the host it came from
    assert any(line.startswith("127.0.0.1:") for line in lines) and any(line.startswith("127.0.0.2:") for line in lines)
    a, b = read_jsonl(single_node_run / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [(m["loss"], m["grad_norm"], m["lr"]) for m in a] == [(m["loss"], m["grad_norm"], m["lr"]) for m in b]
    assert Path(two / "global_step3").is_dir()
    print(f"two nodes over ssh (pdsh): losses {[m['loss'] for m in b]} equal the single-node run's", file=sys.stderr)
