"""Expected GPU memory per rank of a run, from its config: weights, gradients, optimizer state,
activations of the micro-batches in flight, and logits, for the busiest pipeline stage.

    python -m tools.memory_estimate experiment=llama2_70b_2node [more overrides]
    python -m tools.memory_estimate model=llama2_7b num_stages=4 world_size=8 seq_length=4096

`world_size=N` (default: num_stages x tensor_parallel_size x context_parallel_size, i.e. DP=1) sets
DP = N / (num_stages x tensor_parallel_size x context_parallel_size). `gpu_memory_gib=80` also suggests, per
pipeline schedule, a micro-batch size, micro-batch count and partition that fit that much memory per GPU, smallest
bubble first, and the context_parallel_size the seq_length needs to fit. `gpus=N gpu_memory_gib=G` (and
`gpus_per_node=8`, `host_memory_gib=H`) instead proposes whole layouts (PP, TP, CP, EP, DP, micro-batch,
recompute) that fit, ranked by a step-time model, with host memory per node (tools/layout_plan.py), and prints the
top one's overrides to paste.
The micro-batches in flight follow `pipeline_schedule` (the instruction lists its engine executes).
An estimate, not a measurement: it leaves out the CUDA context (~0.5 GiB), allocator fragmentation
and communication buffers; plan for 10-20% on top.
"""

from __future__ import annotations

import sys

from models.families import family_of
from models.moe import experts_per_token
from tools.memory_model import GIB, Estimate, estimate, for_gpu, loss_bytes  # noqa: F401 - the planner's figures


def suggest(cfg, config, world_size: int, gpu_gib: float) -> list[str]:
    """Per pipeline schedule, the largest micro-batch size (and partition) that fits `gpu_gib` per GPU (10% kept
    free), with the micro-batch count that keeps the 1F1B bubble (p-1)/(m+p-1) at or under 20% (at least
    2p for dualpipev), and each schedule's theoretical bubble from its instruction lists; smallest bubble first."""
    from schema.train import min_micro_batches
    from training.schedules import timeline
    from training.validate import validate_layout

    pp, found = cfg.num_stages, []
    tokens = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    for schedule in ("1f1b", "zero_bubble", "dualpipev"):
        best = None  # (micro-batch size, line): the largest that fits, either partition
        for partition in ("parameters", "uniform"):
            for mbs in (16, 8, 4, 2, 1):
                trial = for_gpu(cfg)
                trial.pipeline_schedule, trial.model.partition, trial.micro_batch_size = schedule, partition, mbs
                m = max(4 * (pp - 1), -(-tokens // mbs), min_micro_batches(schedule, pp))
                trial.gradient_accumulation_steps = m
                try:
                    validate_layout(trial, world_size, config)
                except ValueError:
                    break  # this schedule does not run this layout
                busiest = max(r.total for r in estimate(trial, config, world_size)) / GIB
                if busiest <= 0.9 * gpu_gib:
                    if best is None or mbs > best[0]:
                        bubble = timeline(schedule, m, pp).bubble if pp > 1 else 0.0
                        best = (
                            mbs,
                            bubble,
                            f"pipeline_schedule={schedule} model.partition={partition} "
                            f"micro_batch_size={mbs} gradient_accumulation_steps={m}: busiest stage "
                            f"{busiest:.1f} GiB, bubble {bubble:.0%}",
                        )
                    break
        if best:
            found.append(best[1:])
    found.sort(key=lambda f: f[0])
    return [line for _, line in found] or [
        f"nothing fits {gpu_gib} GiB with PP={pp}: add stages, TP, CP, or activation checkpointing"
    ]


def context_for(cfg, config, world_size: int, gpu_gib: float) -> str:
    """The smallest context_parallel_size whose busiest stage fits `gpu_gib` per GPU (10% kept free) at this
    seq_length, keeping PP, TP and DP: the world grows by C. C must divide the heads per TP rank (Ulysses)."""
    from training.validate import validate_layout

    pp, tp = cfg.num_stages, cfg.tensor_parallel_size
    dp = max(1, world_size // (pp * tp * cfg.context_parallel_size))
    heads = config.num_attention_heads // tp
    for c in [c for c in range(1, heads + 1) if heads % c == 0]:
        trial = for_gpu(cfg)
        trial.context_parallel_size = c
        world = pp * tp * c * dp
        try:
            validate_layout(trial, world, config)
        except ValueError:
            continue
        busiest = max(r.total for r in estimate(trial, config, world)) / GIB
        if busiest <= 0.9 * gpu_gib:
            return (
                f"seq_length={cfg.seq_length} needs context_parallel_size={c} (world_size={world}: PP={pp} x TP={tp} "
                f"x CP={c} x DP={dp}): busiest stage {busiest:.1f} GiB"
            )
    return f"seq_length={cfg.seq_length}: no context_parallel_size up to {heads} (the heads per TP rank) fits"


def print_layouts(cfg, config, gpus: int, gpu_gib: float, gpus_per_node: int, host_gib: float = 0) -> int:
    """The layouts that fit (tools/layout_plan.py), fastest first by its step-time model, and the top one to paste."""
    from tools.layout_plan import HEADROOM, propose

    found, too_big = propose(cfg, config, gpus, gpu_gib, gpus_per_node, host_gib=host_gib)
    host = f" and {host_gib:g} GiB of host memory a node" if host_gib else ""
    print(
        f"layouts of {gpus} GPUs ({gpus_per_node} a node) within {HEADROOM:.0%} of {gpu_gib:g} GiB{host}, "
        f"fastest first by the step-time model ({len(found)} fit, {too_big} checked do not):"
    )
    for p in found[:8]:
        print(
            f"  {p.overrides}: {p.gib:.1f} GiB per GPU, host {p.host_gib:.1f} GiB per node, "
            f"step {p.seconds:.2f} s (model), bubble {p.bubble:.0%}"
        )
    if not found:
        print("  none: more GPUs, LoRA, shorter rows, or deepspeed.offload_optimizer")
        return 1
    print(f"paste: world_size={gpus} {found[0].overrides}")
    return 0


def main(argv: list[str]) -> int:
    from common.hub import HubError, resolve
    from schema.compose import compose_config
    from schema.train import sequence_parallel, sequences_per_sample
    from training.assembly import load_model_config
    from training.errors import RunError

    own = ("world_size=", "gpu_memory_gib=", "gpus=", "gpus_per_node=", "host_memory_gib=")
    world = [a for a in argv if a.startswith("world_size=")]
    gpu = [a for a in argv if a.startswith("gpu_memory_gib=")]
    gpus = [int(a.split("=", 1)[1]) for a in argv if a.startswith("gpus=")]
    per_node = [int(a.split("=", 1)[1]) for a in argv if a.startswith("gpus_per_node=")]
    host = [float(a.split("=", 1)[1]) for a in argv if a.startswith("host_memory_gib=")]
    overrides = [a for a in argv if not a.startswith(own)]
    world_size = int(world[-1].split("=", 1)[1]) if world else (gpus[-1] if gpus else None)
    try:
        cfg = for_gpu(compose_config(overrides))
        if cfg.model_name_or_path is None and cfg.model.hidden_size is None:
            raise ValueError("name a model preset (model=...) or an experiment")
        cfg.model_name_or_path = resolve(cfg.model_name_or_path, "model_name_or_path", cfg.model_revision, False)
        config = load_model_config(cfg)
        world_size = world_size or cfg.num_stages * cfg.tensor_parallel_size * cfg.context_parallel_size
        rows = estimate(cfg, config, world_size)
    except (ValueError, RunError, HubError) as e:  # e.g. dualpipev with fewer than 2 x num_stages micro-batches
        print(f"memory_estimate: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    cp = cfg.context_parallel_size
    dp = world_size // (cfg.num_stages * cfg.tensor_parallel_size * cp)
    sp = f", sequence_parallel={str(sequence_parallel(cfg)).lower()}" if cfg.tensor_parallel_size > 1 else ""
    pairs = f" pairs ({sequences_per_sample(cfg)} sequences each)" if cfg.objective == "dpo" else ""
    print(
        f"PP={cfg.num_stages} x TP={cfg.tensor_parallel_size}{f' x CP={cp}' if cp > 1 else ''} x DP={dp}, "
        f"micro-batch {cfg.micro_batch_size}{pairs} x "
        f"{cfg.seq_length} tokens, "
        f"{cfg.deepspeed.precision}, recompute={cfg.model.activation_checkpointing}, "
        f"pipeline_schedule={cfg.pipeline_schedule}{sp}"
    )
    print(" ".join(f"{c:>8}" for c in ("stage", "params", "weights", "grads", "optim", "activ", "logits", "total")))
    for r in rows:
        cells = [r.weights, r.gradients, r.optimizer, r.activations, r.logits, r.total]
        print(f"{r.stage:>5} {r.params / 1e9:>7.2f}B " + " ".join(f"{c / GIB:>7.1f}G" for c in cells))
    print(f"busiest stage: {max(r.total for r in rows) / GIB:.1f} GiB per GPU, plus CUDA context and fragmentation")
    moe = family_of(config).moe
    if moe is not None:
        from models.partition import layer_param_counts

        counts, active = layer_param_counts(config), layer_param_counts(config, active=True)
        tied = counts[-1] if config.tie_word_embeddings else 0  # a tied head is the embedding
        experts = getattr(config, moe.num_experts)
        print(
            f"parameters: {(sum(counts) - tied) / 1e9:.2f}B in all, {(sum(active) - tied) / 1e9:.2f}B used per "
            f"token ({experts} experts, {experts_per_token(config)} routed per token)"
        )
    if gpu and gpus:
        gib = float(gpu[-1].split("=", 1)[1])
        return print_layouts(cfg, config, gpus[-1], gib, per_node[-1] if per_node else 8, host[-1] if host else 0)
    if gpu:
        gib = float(gpu[-1].split("=", 1)[1])
        print(f"fits {gib:g} GiB per GPU:")
        for line in suggest(cfg, config, world_size, gib):
            print(f"  {line}")
        print(f"  {context_for(cfg, config, world_size, gib)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
