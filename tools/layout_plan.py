"""The layouts of a run that fit a cluster: PP x TP x CP x DP (x EP), micro-batch size and recompute, each one's GPU
memory by the planner (tools/memory_estimate.py `estimate`, the figure it prints for the same overrides), its host
memory per node, and a step-time model that ranks them.

    python -m tools.memory_estimate model=llama3_70b seq_length=4096 gpus=16 gpu_memory_gib=80

The step-time model ranks layouts; it is not a measurement. Its terms: the step's model FLOPs (6 x the parameters a
token uses, plus attention's, one more forward with recompute) at `TFLOPS` per GPU; the pipeline bubble of the
schedule's own instruction lists (training/schedules.py `timeline`); TP's and CP's collectives per layer and
micro-batch over NVLink; EP's two all-to-alls per sparse layer and micro-batch, and DP's gradient all-reduce once a
step, over NVLink inside a node or the network across nodes. Host memory per node: an offloaded optimizer's state,
and what asynchronous saves keep in (pinned) host buffers, a snapshot of each rank's checkpoint shard (its optimizer
partition; its stage's weights on the ranks of data index 0, which write the layer files); the tokenized data store
is memory-mapped (the page cache, shared by a node's ranks) and not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

TFLOPS = 989.0 * 0.5  # an H100's dense bf16 peak at 50% utilisation: ranks layouts, never quoted as a speed
NVLINK_GBS = 450.0  # GB/s per GPU inside a node (H100 NVLink, one direction)
NETWORK_GBS = 50.0  # GB/s per GPU across nodes (400 Gb/s InfiniBand)
HEADROOM = 0.9  # a layout fits when the planner's figure is at most this share of the GPU's memory


@dataclass
class Proposal:
    overrides: str  # what to paste (with world_size=gpus)
    gib: float  # the busiest GPU's memory, as the planner prints it for these overrides
    seconds: float  # the step-time model's figure for one step
    host_gib: float  # the busiest node's host memory: offloaded optimizer state, asynchronous saves' snapshots
    bubble: float  # the pipeline's idle share


def propose(
    cfg, config, gpus: int, gpu_gib: float, gpus_per_node: int = 8, rows: int | None = None, host_gib: float = 0
):
    """(the layouts that fit `gpu_gib` per GPU on `gpus` GPUs, fastest first; how many checked did not fit: a
    layout's larger micro-batches, and it without recompute, are not checked once a smaller one does not fit).

    Args:
        cfg: the run config, resolved for a GPU (memory_estimate.for_gpu); its schedule, precision, LoRA, data and
            sequence length are kept, its layout replaced.
        config: the model's transformers config.
        rows: rows (pairs under DPO) per optimizer step, kept by every layout; default: cfg's micro-batch size x
            gradient accumulation steps x the data-parallel degree its own layout would have on `gpus`.
        host_gib: a node's host memory (0: not checked); layouts that need more do not fit.
    """
    from tools.memory_model import GIB, estimate, for_gpu
    from training.validate import validate_layout

    own = cfg.num_stages * cfg.tensor_parallel_size * cfg.context_parallel_size
    rows = rows or cfg.micro_batch_size * cfg.gradient_accumulation_steps * max(1, gpus // own)
    found, too_big = [], 0
    for pp, tp, cp, ep in _layouts(cfg, config, gpus, gpus_per_node):
        dp = gpus // (pp * tp * cp)
        # Memory grows with the micro-batch and without recompute: past the first that does not fit, none does.
        for recompute in (True, False):
            fits = False
            for mbs in (m for m in (1, 2, 4) if rows % (m * dp) == 0):
                trial = for_gpu(cfg)
                trial.num_stages, trial.tensor_parallel_size, trial.context_parallel_size = pp, tp, cp
                trial.expert_parallel_size, trial.micro_batch_size = ep, mbs
                trial.gradient_accumulation_steps = rows // (mbs * dp)
                trial.model.activation_checkpointing = recompute
                try:
                    validate_layout(trial, gpus, config)
                except ValueError:
                    break  # the layout does not run (its micro-batch count, its heads): none of its variants does
                ranks = estimate(trial, config, gpus)
                gib = round(max(r.total for r in ranks) / GIB, 1)  # as memory_estimate prints it
                host = host_bytes_per_node(trial, config, ranks, gpus, gpus_per_node) / GIB
                if gib > HEADROOM * gpu_gib or (host_gib and host > host_gib):
                    too_big += 1
                    break
                fits = True
                seconds, bubble = step_seconds(trial, config, gpus, gpus_per_node)
                overrides = (
                    f"num_stages={pp} tensor_parallel_size={tp} context_parallel_size={cp} expert_parallel_size={ep} "
                    f"micro_batch_size={mbs} gradient_accumulation_steps={trial.gradient_accumulation_steps} "
                    f"model.activation_checkpointing={str(recompute).lower()}"
                )
                found.append(Proposal(overrides, gib, seconds, host, bubble))
            if not fits:
                break  # not even with recompute
    found.sort(key=lambda p: (p.seconds, p.gib))
    return found, too_big


def _layouts(cfg, config, gpus: int, gpus_per_node: int):
    """(PP, TP, CP, EP) candidates: TP inside a node, PP up to the decoder layers, CP for rows past 8,192 tokens, EP
    over the data-parallel ranks where the model has experts. validate_layout says which run."""
    from models.families import family_of

    moe = family_of(config).moe
    experts = getattr(config, moe.num_experts) if moe is not None else 1
    for tp in (t for t in (1, 2, 4, 8) if t <= gpus_per_node and gpus % t == 0):
        for cp in (c for c in (1, 2, 4, 8) if (c == 1 or cfg.seq_length > 8192) and gpus % (tp * c) == 0):
            for pp in (p for p in range(1, config.num_hidden_layers + 1) if gpus % (tp * cp * p) == 0):
                dp = gpus // (tp * cp * pp)
                eps = [e for e in range(1, dp * cp + 1) if (dp * cp) % e == 0 and experts % e == 0] if moe else [1]
                for ep in eps:
                    yield pp, tp, cp, ep


def step_seconds(cfg, config, gpus: int, gpus_per_node: int) -> tuple[float, float]:
    """(the step-time model's seconds for one optimizer step of `cfg` on `gpus` GPUs, the pipeline bubble)."""
    from models.partition import layer_param_counts
    from schema.train import sequences_per_sample
    from training.schedules import timeline

    pp, tp, cp, ep = cfg.num_stages, cfg.tensor_parallel_size, cfg.context_parallel_size, cfg.expert_parallel_size
    dp, mbs, m = gpus // (pp * tp * cp), cfg.micro_batch_size, cfg.gradient_accumulation_steps
    seq, hidden, layers = cfg.seq_length, config.hidden_size, config.num_hidden_layers
    sequences = mbs * sequences_per_sample(cfg)  # per micro-batch
    recompute = bool(cfg.model.activation_checkpointing)
    per_token = 6 * sum(layer_param_counts(config, active=True)) + 6 * layers * seq * hidden  # fwd+bwd, causal
    flops = per_token * sequences * seq * m * dp * (4 / 3 if recompute else 1)
    bubble = timeline(str(cfg.pipeline_schedule), m, pp).bubble if pp > 1 else 0.0
    compute = flops / gpus / (TFLOPS * 1e12) / (1 - bubble)
    act = sequences * seq * hidden * 2 / cp  # bytes of one [micro-batch, S/CP, H] bf16 activation
    per_layer = 0.0  # seconds of collectives per layer and micro-batch on one rank
    if tp > 1:  # 2 all-reduces forward, 2 backward (+2 with recompute), ring: 2 (T-1)/T of the tensor
        per_layer += (4 + 2 * recompute) * act * 2 * (tp - 1) / tp / (NVLINK_GBS * 1e9)
    if cp > 1:  # Ulysses: 2 all-to-alls forward, 2 backward (+2 with recompute) of q/k/v/out-sized tensors
        per_layer += (4 + 2 * recompute) * 2 * act * (cp - 1) / cp / (_bandwidth(tp * cp, gpus_per_node) * 1e9)
    moe_layers = 0
    if ep > 1:  # dispatch and combine, forward and backward, of each token's top-k copies
        from models.moe import experts_per_token

        moe_layers = sum(count > 0 for count in layer_param_counts(config, experts_only=True))
        routed = act * experts_per_token(config) * 4 * (ep - 1) / ep / (_bandwidth(tp * ep, gpus_per_node) * 1e9)
        per_layer += routed * moe_layers / layers
    collectives = per_layer * layers / pp * m / (1 - bubble)
    params = sum(layer_param_counts(config)) / pp / tp  # a rank's share, bf16 gradients all-reduced over DP
    grads = 2 * params * 2 * (dp - 1) / dp / (_bandwidth(gpus, gpus_per_node) * 1e9) if dp > 1 else 0.0
    return compute + collectives + grads, bubble


def _bandwidth(span: int, gpus_per_node: int) -> float:
    """GB/s per GPU of a group whose ranks span `span` consecutive GPUs."""
    return NVLINK_GBS if span <= gpus_per_node else NETWORK_GBS


def host_bytes_per_node(cfg, config, ranks, gpus: int, gpus_per_node: int) -> float:
    """The busiest node's host memory: the optimizer state where it is offloaded (deepspeed.offload_optimizer), and
    for asynchronous saves (checkpoint.async_save) each rank's snapshot of its checkpoint shard (optimizer
    partition; the stage's weights on data index 0). Ranks are numbered as DeepSpeed's topology numbers them (pipe,
    data, model: TP fastest)."""
    import copy

    from tools.memory_model import estimate

    offloaded = cfg.deepspeed.offload_optimizer
    if offloaded:  # the optimizer state lives in host memory: the planner's figure for it on the GPU
        on_gpu = copy.deepcopy(cfg)
        on_gpu.deepspeed.offload_optimizer = False
        ranks = [
            dataclasses.replace(r, optimizer=g.optimizer)
            for r, g in zip(ranks, estimate(on_gpu, config, gpus), strict=True)
        ]
    saves = 1 if cfg.checkpoint.async_save else 0
    tp = cfg.tensor_parallel_size
    data = gpus // (cfg.num_stages * tp)  # DP x CP ranks of a stage
    per_rank = []
    for rank in range(gpus):
        stage, index = rank // (data * tp), (rank // tp) % data
        row = next((r for r in ranks if r.stage == stage), ranks[-1])
        per_rank.append(row.optimizer * (saves + offloaded) + saves * (row.weights if index == 0 else 0.0))
    nodes = range(0, gpus, gpus_per_node)
    return max(sum(per_rank[n : n + gpus_per_node]) for n in nodes)
