"""Peak memory of the last stage's loss, plain vs chunked (`model.loss_chunk_size`), forward + backward.

    python -m benchmarks.loss_memory [--batch 2 --seq 2048 --vocab 32000 --dtype bf16 --chunks 0,1024,4096]

Each variant runs in a fresh child process: logits [B, S, V] that require a gradient (what the LM head
hands the loss), then the loss and its backward, as `CausalLMLoss` does on the last stage. Reported: the
child's peak RSS above the RSS it had with the logits allocated (getrusage), and the time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import resource, sys, time, torch
from models.loss import CausalLMLoss
b, s, v, dtype, chunk = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
torch.manual_seed(0)
logits = torch.randn(b, s, v, dtype=getattr(torch, dtype)).requires_grad_()
labels = torch.randint(0, v, (b, s))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
loss = CausalLMLoss(chunk=chunk)(logits, (labels, torch.tensor(1.0 / (b * s))))
loss.backward()
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(float(loss), (peak - base) / 1024, seconds)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunks", default="0,1024,4096", help="loss_chunk_size values (0: the plain loss)")
    args = p.parse_args()
    logits_mib = args.batch * args.seq * args.vocab * (2 if "16" in args.dtype else 4) / 2**20
    print(f"logits [{args.batch}, {args.seq}, {args.vocab}] {args.dtype}: {logits_mib:.0f} MiB")
    for chunk in [int(c) for c in args.chunks.split(",")]:
        cmd = [sys.executable, "-c", CHILD, str(args.batch), str(args.seq), str(args.vocab), args.dtype, str(chunk)]
        loss, mib, seconds = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO).stdout.split()
        name = f"chunk {chunk} tokens" if chunk else "plain (all tokens at once)"
        print(f"{name}: loss {float(loss):.6f}, peak above the logits {float(mib):.0f} MiB, {float(seconds):.2f}s")


if __name__ == "__main__":
    main()
