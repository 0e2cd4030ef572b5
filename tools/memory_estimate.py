"""Expected GPU memory per rank of a run, from its config: weights, gradients, optimizer state,
activations of the micro-batches in flight, and logits, for the busiest pipeline stage.

    python -m tools.memory_estimate experiment=llama2_70b_2node [more overrides]
    python -m tools.memory_estimate model=llama2_7b num_stages=4 world_size=8 seq_length=4096

`world_size=N` (default: num_stages, i.e. DP=1) sets DP = N / num_stages.
An estimate, not a measurement: it leaves out the CUDA context (~0.5 GiB), allocator fragmentation
and communication buffers; plan for 10-20% on top.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

GIB = 1024**3


@dataclass
class Estimate:
    stage: int
    params: int
    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits


def estimate(cfg, config, world_size: int) -> list[Estimate]:
    """Bytes per GPU for every stage of `cfg` (a TrainConfig) on a model `config` (a LlamaConfig)."""
    from models.layout import block_of
    from models.partition import layer_param_counts, stage_bounds
    from training.engine import resolve_precision, resolve_zero_stage

    pp = cfg.num_stages
    dp = max(1, world_size // pp)
    precision = resolve_precision(cfg.deepspeed.precision, auto="bf16")  # planning for a bf16 GPU
    zero = resolve_zero_stage(cfg.deepspeed.zero_stage, gpu=True)
    weight_bytes = 4 if precision == "fp32" else 2
    accum = cfg.deepspeed.grad_accum_dtype or ("fp32" if precision in ("bf16", "fp32") else "fp16")
    grad_bytes = 4 if accum == "fp32" else 2
    # fp32 master copy (not for fp32 runs) + Adam's two moments, sharded over DP by ZeRO-1, or in CPU RAM.
    optim_bytes = (0 if precision == "fp32" else 4) + 8
    optim_share = 0.0 if cfg.deepspeed.offload_optimizer else (1 / dp if zero >= 1 else 1.0)
    counts = layer_param_counts(config)
    bounds = stage_bounds(config, pp, cfg.model.partition)
    b, s, h = cfg.micro_batch_size, cfg.seq_length, config.hidden_size
    act_bytes = 2 if precision != "fp32" else 4
    out = []
    for stage in range(pp):
        params = sum(counts[bounds[stage] : bounds[stage + 1]])
        own = range(bounds[stage], bounds[stage + 1])
        decoders = sum(block_of(i, config.num_hidden_layers) is not None for i in own)
        in_flight = min(pp - stage, cfg.gradient_accumulation_steps)  # 1F1B: stage s holds pp - s micro-batches
        # Per decoder layer and micro-batch, with SDPA/flash attention (no S x S scores kept): about
        # 17 tensors of B x S x H in activation precision (Korthikanti et al. 2022, Table 2, without the
        # attention-matrix term). With recomputation only each layer's input is kept, plus one layer live.
        per_layer = 17 * b * s * h * act_bytes
        if cfg.model.activation_checkpointing:
            activations = in_flight * decoders * b * s * h * act_bytes + per_layer
        else:
            activations = in_flight * decoders * per_layer
        logits = 3 * b * s * config.vocab_size * 4 if stage == pp - 1 else 0  # fp32 logits, log-softmax, grad
        out.append(
            Estimate(
                stage,
                params,
                params * weight_bytes,
                params * grad_bytes,
                params * optim_bytes * optim_share,
                activations,
                logits,
            )  # fmt: skip
        )
    return out


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.assembly import load_model_config
    from training.config import TrainConfig, register_configs

    world = [a for a in argv if a.startswith("world_size=")]
    overrides = [a for a in argv if not a.startswith("world_size=")]
    world_size = int(world[-1].split("=", 1)[1]) if world else None
    register_configs()
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        cfg: TrainConfig = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    if cfg.model_name_or_path is None and cfg.model.hidden_size is None:
        print("memory_estimate: error: name a model preset (model=...) or an experiment", file=sys.stderr)
        return 2
    config = load_model_config(cfg)
    world_size = world_size or cfg.num_stages
    rows = estimate(cfg, config, world_size)
    dp = world_size // cfg.num_stages
    print(f"PP={cfg.num_stages} x DP={dp}, micro-batch {cfg.micro_batch_size} x {cfg.seq_length} tokens, "
          f"{cfg.deepspeed.precision}, recompute={cfg.model.activation_checkpointing}")  # fmt: skip
    print(" ".join(f"{c:>8}" for c in ("stage", "params", "weights", "grads", "optim", "activ", "logits", "total")))
    for r in rows:
        cells = [r.weights, r.gradients, r.optimizer, r.activations, r.logits, r.total]
        print(f"{r.stage:>5} {r.params / 1e9:>7.2f}B " + " ".join(f"{c / GIB:>7.1f}G" for c in cells))
    print(f"busiest stage: {max(r.total for r in rows) / GIB:.1f} GiB per GPU, plus CUDA context and fragmentation")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
