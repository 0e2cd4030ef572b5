"""Print a TCP port that is free on this machine, for `deepspeed --master_port` (scripts/demo.sh, docs/training.md).

    deepspeed --num_gpus 4 --master_port $(python -m tools.free_port) trainer.py ...

Two jobs on one node must not share a port (training/rendezvous.py refuses the second in one line). The port is
drawn below the kernel's ephemeral range: a port the kernel hands out for port 0 can be handed out again to another
process's outgoing socket before the launcher binds it.
"""

from __future__ import annotations

import random
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, drawn at random below the ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not a seeded global RNG
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found below the ephemeral range")


if __name__ == "__main__":
    print(free_port())
