"""The optimizer step's seconds, Muon (`optim.name=muon`) against AdamW, on a SmolLM2-135M-shape model, and how Muon's
step scales with tensor parallelism (each rank gathers each split matrix over its TP group and orthogonalises it
whole: training/muon.py).

    python -m benchmarks.muon_step [--tp 1,2] [--repeats 5]

CPU ranks over gloo (fp32 parameters and gradients, random gradients); medians of `--repeats` steps after one warm-up
step. Prints one line per (optimizer, TP), with the matrices rank 0 orthogonalised and its Newton-Schulz seconds (the
rest of a TP step is the gathers and scatters).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time

import torch

SMOLLM2 = dict(  # HuggingFaceTB/SmolLM2-135M's shape
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
)


def _step_seconds(rank: int, tp: int, name: str, ns: str, repeats: int, port: int, out) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from models.sharding import REPLICA, shard
    from models.tp_collectives import TensorParallel
    from schema.train import OptimConfig, TrainConfig
    from training.engine import make_optimizer
    from training.muon import layer_plan

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2)
    model = LlamaForCausalLM(config)
    layer = re.compile(r"model\.layers\.\d+\.(.+)")
    plans = {}
    for n, p in model.named_parameters():  # this TP rank's shard of every split matrix
        m = layer.fullmatch(n)
        plan = layer_plan(m.group(1), p, config) if m else None
        plans[n] = plan
        if plan is not None and plan[0] != REPLICA and tp > 1:
            p.data = shard(p.data, plan[0], rank, tp)
    cfg = TrainConfig(optim=OptimConfig(name=name, muon_ns_dtype=ns))
    tp_place = TensorParallel(size=tp, rank=rank, group=dist.group.WORLD)
    optimizer, _ = make_optimizer(cfg, model.named_parameters(), 10, lambda n, p: plans[n], tp_place)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    import training.muon as muon

    plain, spent = muon.newton_schulz, []  # this rank's Newton-Schulz calls and seconds in each step

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = plain(*args, **kwargs)
        spent[-1][0] += 1
        spent[-1][1] += time.perf_counter() - start
        return result

    muon.newton_schulz = timed
    times = []
    for _ in range(repeats + 1):
        spent.append([0, 0.0])
        dist.barrier()
        start = time.perf_counter()
        optimizer.step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put((statistics.median(times[1:]), spent[-1][0], statistics.median(s for _, s in spent[1:])))
    dist.destroy_process_group()


def measure(tp: int, name: str, ns: str, repeats: int) -> float:
    import torch.multiprocessing as mp

    from tools.free_port import free_port

    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    procs = [context.Process(target=_step_seconds, args=(r, tp, name, ns, repeats, port, out)) for r in range(tp)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", default="1,2")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"SmolLM2-135M shape, {torch.get_num_threads()} threads, medians of {args.repeats} steps")
    adamw, _, _ = measure(1, "adamw", "bf16", args.repeats)
    print(f"adamw TP=1: {adamw:.3f} s")
    for tp in [int(t) for t in args.tp.split(",")]:
        for ns in ("bf16", "fp32"):
            seconds, calls, ns_seconds = measure(tp, "muon", ns, args.repeats)
            print(
                f"muon ({ns} Newton-Schulz) TP={tp}: {seconds:.3f} s ({seconds / adamw:.1f}x AdamW at TP=1); "
                f"rank 0 orthogonalised {calls} matrices in {ns_seconds:.3f} s"
            )


if __name__ == "__main__":
    main()
