"""Expected GPU memory per rank of a run, from its config: weights, gradients, optimizer state,
activations of the micro-batches in flight, and logits, for the busiest pipeline stage.

    python -m tools.memory_estimate experiment=llama2_70b_2node [more overrides]
    python -m tools.memory_estimate model=llama2_7b num_stages=4 world_size=8 seq_length=4096

`world_size=N` (default: num_stages x tensor_parallel_size, i.e. DP=1) sets
DP = N / (num_stages x tensor_parallel_size). `gpu_memory_gib=80` also suggests a micro-batch size,
micro-batch count and partition that fit that much memory per GPU.
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


def norm_bytes(h: int, act_bytes: int) -> int:
    """Per token, what an RMSNorm saves: its fp32 input, the fp32 1/rms, its normalised output and the
    flattened copy the next matmul saves (both in the compute dtype)."""
    return 4 * h + 4 + 2 * h * act_bytes


def layer_activation_bytes(config, b: int, s: int, tp: int, act_bytes: int, attn: str, packed: bool) -> float:
    """Bytes one decoder block keeps for backward per micro-batch (tensors autograd saves, counted once).

    Counted from what the HF LLaMA block saves (tests/test_memory_estimate.py measures it with
    `torch.autograd.graph.saved_tensors_hooks`), per token: each RMSNorm `norm_bytes`; RoPE cos/sin
    2 x head_dim; attention q, k, v after RoPE, the SDPA/flash output rows and o_proj's input:
    2h + 2 x kv_dim, plus the log-sum-exp per head (fp32); SwiGLU gate, up, act(gate) and down's input:
    4 x intermediate. Tensor parallelism divides attention and MLP, not the norms or RoPE. Eager
    attention adds the probabilities (heads x S per token); packed rows on SDPA/eager add the mask
    (S per token); flash-attn keeps neither (Korthikanti et al.'s sbh(34 + 5as/h), specialised to LLaMA).
    """
    h, heads, inter = config.hidden_size, config.num_attention_heads, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_dim = config.num_key_value_heads * head_dim
    per_token = 2 * norm_bytes(h, act_bytes) + 2 * head_dim * act_bytes
    per_token += ((heads * head_dim + h + 2 * kv_dim + 4 * inter) * act_bytes + heads * 4) / tp
    if attn == "eager":
        per_token += heads / tp * s * act_bytes
    if packed and attn != "flash_attention_2":
        per_token += s * act_bytes
    return b * s * per_token


def stage_activation_bytes(config, layers: range, b: int, s: int, tp: int, act_bytes: int, attn: str, packed: bool,
                           every: int) -> tuple[float, float]:  # fmt: skip
    """(bytes kept per micro-batch in flight, bytes of the one block being recomputed) for the pipeline layers
    `layers` of a stage; `every`: recompute every k-th block (0: none), keeping only its input. The final
    norm and the LM head's input count on the last stage; the loss's logits are `Estimate.logits`."""
    from models.key_table import EMBED, NORM, block_of, pipe_layers

    n = config.num_hidden_layers
    per_layer = layer_activation_bytes(config, b, s, tp, act_bytes, attn, packed)
    kept, live = 0.0, 0.0
    kinds = {layer.index: layer.kind for layer in pipe_layers(n, config.tie_word_embeddings)}
    for index in layers:
        block = block_of(index, n)
        if block is not None and every and block % every == 0:
            kept, live = kept + b * s * config.hidden_size * act_bytes, per_layer
        elif block is not None:
            kept += per_layer
        elif kinds[index] == NORM:
            kept += b * s * (norm_bytes(config.hidden_size, act_bytes) + config.hidden_size * act_bytes)  # + head input
        elif kinds[index] == EMBED:
            kept += b * s * 8  # token ids
    return kept, live


def estimate(cfg, config, world_size: int) -> list[Estimate]:
    """Bytes per GPU for every stage of `cfg` (a TrainConfig) on a model `config` (a LlamaConfig)."""
    from models.config import checkpoint_every
    from models.partition import layer_param_counts, stage_bounds
    from models.sharding import padded_vocab
    from models.tensor_parallel import TensorParallel
    from training.engine import resolve_precision, resolve_zero_stage

    pp, tp = cfg.num_stages, cfg.tensor_parallel_size
    dp = max(1, world_size // (pp * tp))
    precision = resolve_precision(cfg.deepspeed.precision, auto="bf16")  # planning for a bf16 GPU
    zero = resolve_zero_stage(cfg.deepspeed.zero_stage, gpu=True)
    weight_bytes = 4 if precision == "fp32" else 2
    accum = cfg.deepspeed.grad_accum_dtype or ("fp32" if precision in ("bf16", "fp32") else "fp16")
    grad_bytes = 4 if accum == "fp32" else 2
    # fp32 master copy (not for fp32 runs) + Adam's two moments, sharded over DP by ZeRO-1, or in CPU RAM.
    optim_bytes = (0 if precision == "fp32" else 4) + 8
    optim_share = 0.0 if cfg.deepspeed.offload_optimizer else (1 / dp if zero >= 1 else 1.0)
    counts = layer_param_counts(config, TensorParallel(tp, 0, cfg.model.vocab_pad_multiple))  # one TP rank's share
    bounds = stage_bounds(config, pp, cfg.model.partition)
    b, s = cfg.micro_batch_size, cfg.seq_length
    every = checkpoint_every(cfg.model)
    act_bytes = 2 if precision != "fp32" else 4
    attn = str(cfg.model.attn_implementation)
    out = []
    for stage in range(pp):
        params = sum(counts[bounds[stage] : bounds[stage + 1]])
        own = range(bounds[stage], bounds[stage + 1])
        in_flight = min(pp - stage, cfg.gradient_accumulation_steps)  # 1F1B: stage s holds pp - s micro-batches
        packed = cfg.data.documents_share_rows
        kept, live = stage_activation_bytes(config, own, b, s, tp, act_bytes, attn, packed, every)
        activations = in_flight * kept + live
        vocab = padded_vocab(config.vocab_size, tp, cfg.model.vocab_pad_multiple) // tp  # vocab-parallel head
        chunk = min(cfg.model.loss_chunk_size or b * s, b * s)
        # Logits in the compute dtype and their gradient, plus fp32 logits and softmax of one chunk of tokens.
        logits = (2 * b * s * vocab * act_bytes + 2 * chunk * vocab * 4) if stage == pp - 1 else 0
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


def suggest(cfg, config, world_size: int, gpu_gib: float) -> list[str]:
    """Micro-batch sizes and partitions that fit `gpu_gib` per GPU (10% kept free), largest micro-batch
    first, with the micro-batch count that keeps the pipeline bubble (p-1)/(m+p-1) at or under 20%."""
    import copy

    pp, lines = cfg.num_stages, []
    tokens = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    for partition in ("parameters", "uniform"):
        for mbs in (16, 8, 4, 2, 1):
            trial = copy.deepcopy(cfg)
            trial.model.partition, trial.micro_batch_size = partition, mbs
            trial.gradient_accumulation_steps = max(4 * (pp - 1), -(-tokens // mbs), 1)
            busiest = max(r.total for r in estimate(trial, config, world_size)) / GIB
            if busiest <= 0.9 * gpu_gib:
                m = trial.gradient_accumulation_steps
                lines.append(f"model.partition={partition} micro_batch_size={mbs} gradient_accumulation_steps={m}: "
                             f"busiest stage {busiest:.1f} GiB, bubble {(pp - 1) / (m + pp - 1):.0%}")  # fmt: skip
                break
    return lines or [f"nothing fits {gpu_gib} GiB with PP={pp}: add stages, TP, or activation checkpointing"]


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.assembly import load_model_config
    from training.config import TrainConfig, register_configs

    world = [a for a in argv if a.startswith("world_size=")]
    gpu = [a for a in argv if a.startswith("gpu_memory_gib=")]
    overrides = [a for a in argv if not a.startswith(("world_size=", "gpu_memory_gib="))]
    world_size = int(world[-1].split("=", 1)[1]) if world else None
    register_configs()
    conf_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf_dir, version_base="1.3"):
        cfg: TrainConfig = OmegaConf.to_object(compose(config_name="config", overrides=overrides))
    if cfg.model_name_or_path is None and cfg.model.hidden_size is None:
        print("memory_estimate: error: name a model preset (model=...) or an experiment", file=sys.stderr)
        return 2
    config = load_model_config(cfg)
    world_size = world_size or cfg.num_stages * cfg.tensor_parallel_size
    rows = estimate(cfg, config, world_size)
    dp = world_size // (cfg.num_stages * cfg.tensor_parallel_size)
    print(f"PP={cfg.num_stages} x TP={cfg.tensor_parallel_size} x DP={dp}, "
          f"micro-batch {cfg.micro_batch_size} x {cfg.seq_length} tokens, "
          f"{cfg.deepspeed.precision}, recompute={cfg.model.activation_checkpointing}")  # fmt: skip
    print(" ".join(f"{c:>8}" for c in ("stage", "params", "weights", "grads", "optim", "activ", "logits", "total")))
    for r in rows:
        cells = [r.weights, r.gradients, r.optimizer, r.activations, r.logits, r.total]
        print(f"{r.stage:>5} {r.params / 1e9:>7.2f}B " + " ".join(f"{c / GIB:>7.1f}G" for c in cells))
    print(f"busiest stage: {max(r.total for r in rows) / GIB:.1f} GiB per GPU, plus CUDA context and fragmentation")
    if gpu:
        gib = float(gpu[-1].split("=", 1)[1])
        print(f"fits {gib:g} GiB per GPU:")
        for line in suggest(cfg, config, world_size, gib):
            print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
