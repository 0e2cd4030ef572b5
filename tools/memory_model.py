"""The planner's memory model: bytes per GPU of every pipeline rank of a run (weights, gradients, optimizer state,
activations of the micro-batches in flight, the head and loss), from its config and the model's. What
`python -m tools.memory_estimate` prints and the layout planner (tools/layout_plan.py) ranks; below both."""

from __future__ import annotations

from dataclasses import dataclass

from models.families import resolve_attention
from tools.activation_bytes import deferred_weight_grad_bytes, stage_activation_bytes, transient_bytes

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


def for_gpu(cfg):
    """A copy of `cfg` with its precision and ZeRO stage resolved as on a bf16 GPU: what the planner plans for
    (training/precision.py)."""
    import copy

    from training.precision import resolved

    cfg = copy.deepcopy(cfg)
    cfg.deepspeed = resolved(cfg.deepspeed, auto="bf16", gpu=True)
    return cfg


def estimate(cfg, config, world_size: int) -> list[Estimate]:
    """Bytes per GPU for every pipeline rank of `cfg` (a TrainConfig) on a model `config` (a LlamaConfig).

    The micro-batches in flight come from the instruction list the rank's engine executes
    (`training.schedules.memory_states`): 1F1B's p - s on stage s; zero_bubble the same plus at most two
    backward passes' deferred weight gradients; dualpipev's two half stages per rank, rank 0 scoring the loss."""
    from models.lora import adapter_param_counts
    from models.partition import layer_param_counts, rank_stages, stage_bounds
    from models.pipe_layout import block_of
    from models.sharding import padded_vocab
    from models.tensor_parallel import TensorParallel
    from schema.model import checkpoint_every
    from schema.train import model_stages, padded_seq_length, sequence_parallel, sequences_per_sample
    from training.precision import resolved
    from training.schedules import memory_states

    pp, tp, cp, schedule = cfg.num_stages, cfg.tensor_parallel_size, cfg.context_parallel_size, cfg.pipeline_schedule
    dual = schedule == "dualpipev"
    dp = max(1, world_size // (pp * tp * cp))
    ds = resolved(cfg.deepspeed, auto="bf16", gpu=True)  # planning for a bf16 GPU, as `for_gpu`
    precision, zero = str(ds.precision), ds.zero_stage
    weight_bytes = 4 if precision == "fp32" else 2
    accum = cfg.deepspeed.grad_accum_dtype or ("fp32" if precision in ("bf16", "fp32") else "fp16")
    grad_bytes = 4 if accum == "fp32" else 2
    # fp32 master copy (not for fp32 runs) + Adam's two moments, sharded over DP by ZeRO-1, or in CPU RAM.
    optim_bytes = (0 if precision == "fp32" else 4) + 8
    # ZeRO-1 shards over DeepSpeed's data-parallel ranks: DP x CP (training/topology.py).
    optim_share = 0.0 if cfg.deepspeed.offload_optimizer else (1 / (dp * cp) if zero >= 1 else 1.0)
    # One TP rank's share, and with expert parallelism one EP rank's E / ep experts of each sparse block, whose
    # optimizer state ZeRO-1 shards over the DP / ep ranks holding the same experts (training/expert_parallel.py).
    ep, shard = cfg.expert_parallel_size, TensorParallel(tp, 0, cfg.model.vocab_pad_multiple)
    counts = layer_param_counts(config, shard, ep=ep)
    # LoRA: the base weights frozen (no gradients, no optimizer state); the adapters train (models/lora.py).
    adapters = adapter_param_counts(config, cfg.lora.target_modules, cfg.lora.r, tp) if cfg.lora.enabled else None
    # QLoRA: the decoder linears' weights held in NF4 (models/nf4.py), per layer (weights, their bytes)
    lo = cfg.lora
    nf4 = nf4_layer_counts(config, shard, lo.quantize_double, lo.quantize_experts, ep) if lo.quantize == "nf4" else None
    if lo.keep_quantized:  # the hub's FP8 blocks / MXFP4 experts held as they are (checkpoint/kept_quantized.py)
        nf4 = kept_layer_counts(config, ep, *hub_quantization(cfg.model_name_or_path, config), tp=shard)
    expert_counts = layer_param_counts(config, shard, ep=ep, experts_only=True) if ep > 1 else [0] * len(counts)
    expert_share = optim_share * ep if zero >= 1 else optim_share
    stages = model_stages(schedule, pp)
    bounds = stage_bounds(config, stages, cfg.model.partition)
    row = padded_seq_length(cfg)
    b, s = cfg.micro_batch_size * sequences_per_sample(cfg), row // cp  # this rank's positions of each row
    every = checkpoint_every(cfg.model)
    act_bytes = 2 if precision != "fp32" else 4
    attn = resolve_attention(config, cfg.model.attn_implementation and str(cfg.model.attn_implementation))
    packed = cfg.data.documents_share_rows
    sp = sequence_parallel(cfg)
    routed = cfg.moe.routed_experts or cfg.expert_parallel_size > 1
    lora = (cfg.lora.target_modules, cfg.lora.r) if cfg.lora.enabled else ((), 0)
    deferred = deferred_weight_grad_bytes(config, b, s, tp, act_bytes, *lora) if schedule == "zero_bubble" else 0
    n, out = config.num_hidden_layers, []
    for stage in range(pp):
        halves = rank_stages(stages, pp, stage)
        own = [range(bounds[h], bounds[h + 1]) for h in halves]
        held_layers = {i for r in own for i in r}
        params = sum(counts[i] for i in held_layers)
        experts = sum(expert_counts[i] for i in held_layers)
        if config.tie_word_embeddings and {0, len(counts) - 1} <= held_layers:
            params -= counts[-1]  # a tied head on the embedding's rank is the embedding itself (PP=1, DualPipeV)
        per_half = [
            stage_activation_bytes(
                config,
                r,
                b,
                s,
                tp,
                act_bytes,
                attn,
                packed,
                every,
                sp,
                cfg.model.vocab_pad_multiple,
                routed,
                row,
                cfg.model.mlp_tiles > 1,
            )
            for r in own
        ]
        kept = [k for k, _ in per_half] + [0.0]
        blocks = sum(1 for r in own for i in r if block_of(i, n) is not None)
        states = memory_states(schedule, cfg.gradient_accumulation_steps, pp, stage)
        held = max(a * kept[0] + c * kept[1] + w * blocks * deferred for a, c, w in states)
        activations = held + max(live for _, live in per_half) + transient_bytes(config, b, s)
        vocab = padded_vocab(config.vocab_size, tp, cfg.model.vocab_pad_multiple) // tp  # vocab-parallel head
        scores = stage == (0 if dual else pp - 1)
        logits = loss_bytes(cfg.model, b * s, config.hidden_size, vocab, act_bytes) if scores else 0
        if adapters is None:
            trained, weights = params, params * weight_bytes
            optimizer = (params - experts) * optim_bytes * optim_share + experts * optim_bytes * expert_share
            if cfg.optim.name == "muon" and (precision, zero) in (("fp32", 0), ("bf16", 1)):  # (training/validate.py)
                ns_bytes = 4 if cfg.optim.muon_ns_dtype == "fp32" else 2
                matrices, gathered = muon_bytes(config, held_layers, tp, ep, ns_bytes)
                # one buffer for Adam's two moments; under ZeRO-1 the step also holds one partition-sized buffer
                optimizer += gathered - matrices / 2 * optim_share * (1 if zero == 0 else 0)
        else:  # only the adapters take gradients and optimizer state
            trained = sum(adapters[i] for i in held_layers)
            weights, optimizer = (params + trained) * weight_bytes, trained * optim_bytes * optim_share
            if nf4 is not None:  # (and one layer's experts dequantized for its forward: `hold_experts`)
                weights += sum(nf4[i][1] - nf4[i][0] * weight_bytes for i in held_layers)
                weights += max((nf4[i][2] for i in held_layers), default=0) * act_bytes
        out.append(Estimate(stage, params, weights, trained * grad_bytes, optimizer, activations, logits))
    return out


def nf4_layer_counts(config, tp, double: bool, experts: bool = False, ep: int = 1) -> list[tuple[int, int, int]]:
    """QLoRA's base per pipeline layer, one tensor-parallel rank's share: (the weights held in NF4, the bytes they
    take so: `models.nf4.nf4_bytes` of each linear layer's weight and, with `experts`, of each fused expert tensor
    of this EP rank's E / ep experts; those expert weights, dequantized for the layer's forward). On the meta
    device."""
    import torch

    from models.nf4 import nf4_bytes, nf4_experts, nf4_linears
    from models.partition import layer_shape
    from models.pipe_layout import DECODER, pipe_layers

    layers, done = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings), {}
    with torch.device("meta"):
        for layer in layers:
            shape = layer_shape(layer, config)
            if layer.kind == DECODER and shape not in done:
                built = tp_layer(layer, config, tp)
                sizes = [linear.weight.numel() for _, linear in nf4_linears(built)]
                sparse = nf4_experts(built) if experts else None
                local = [p.numel() // ep for p in sparse[1].parameters(recurse=False) if p.dim() == 3] if sparse else []
                done[shape] = (sum(sizes + local), sum(nf4_bytes(n, double) for n in sizes + local), sum(local))
    return [done.get(layer_shape(layer, config), (0, 0, 0)) for layer in layers]


def hub_quantization(source: str | None, config) -> tuple:
    """(the config that says how the hub quantized a model, the hub's keys or None): model_name_or_path's own where
    it is a Hugging Face directory (a run's model config leaves its quantization out: it computes with the
    dequantized weights), else `config` and None (a preset: as its release quantizes it)."""
    from checkpoint.hf_reader import is_hf_dir, read_model_config, validate

    return (read_model_config(source), validate(source)) if source and is_hf_dir(source) else (config, None)


def kept_layer_counts(config, ep: int = 1, quant=None, present=None, tp=None) -> list[tuple[int, int, int]]:
    """`lora.keep_quantized`'s base per pipeline layer, one tensor-parallel rank's share (`tp`, whose shards hold
    whole blocks; default whole), as `nf4_layer_counts` counts QLoRA's, from the `quantization_config` of `quant`
    (default `config`; `hub_quantization`): with the hub's keys `present`, what
    `checkpoint.kept_quantized.hold_hub_weights` holds of them (`planned_bytes`); without, as the releases quantize:
    FP8 every decoder linear layer and this EP rank's experts, MXFP4 and INT4 the experts only. On the meta
    device."""
    import math

    import torch

    from checkpoint.dequantize import fp8_blocks, int4_group, is_fp8, is_mxfp4
    from checkpoint.kept_quantized import planned_bytes
    from models.frozen_weights import expert_weights, held_class
    from models.hub_quantized import fp8_bytes, int4_bytes, mxfp4_bytes
    from models.layers import build_layer
    from models.moe import is_moe, num_experts
    from models.nf4 import nf4_experts
    from models.partition import layer_shape
    from models.pipe_layout import DECODER, pipe_layers

    quant = quant or config
    fp8, block, group = is_fp8(quant), fp8_blocks(quant), int4_group(quant)
    mine = range(num_experts(config) // ep) if is_moe(config) else None
    layers, done = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings), {}
    with torch.device("meta"):
        for layer in layers:
            shape = layer_shape(layer, config)
            if layer.kind != DECODER or shape in done or not (fp8 or is_mxfp4(quant) or group is not None):
                continue
            built = build_layer(layer, config) if tp is None else tp_layer(layer, config, tp)
            if present is not None:
                done[shape] = planned_bytes(built, config, quant, present, mine)
                continue
            linears = [m.weight.shape for m in built.modules() if held_class(type(m)) and fp8]
            numel, held = sum(r * c for r, c in linears), sum(fp8_bytes(r, c, block) for r, c in linears)
            local = 0
            if (sparse := nf4_experts(built)) is not None:
                for name in expert_weights(sparse[1]):
                    experts, *matrix = getattr(sparse[1], name).shape
                    local += experts // ep * math.prod(matrix)
                    one = fp8_bytes(*matrix, block) if fp8 else mxfp4_bytes(math.prod(matrix))
                    one = int4_bytes(*matrix, group) if group is not None else one
                    held += experts // ep * one
            done[shape] = (numel + local, held, local)
    return [done.get(layer_shape(layer, config), (0, 0, 0)) for layer in layers]


def tp_layer(layer, config, tp):
    """One tensor-parallel rank's module of pipeline layer `layer` (on the current device)."""
    from models.tensor_parallel import tp_layer_class_and_args

    cls, args = tp_layer_class_and_args(layer, config, tp)
    return cls(*args)


def muon_bytes(config, held_layers, tp: int, ep: int, ns_bytes: int) -> tuple[float, float]:
    """Muon on a rank holding the pipeline layers `held_layers`, before any ZeRO-1 partitioning (the caller applies
    it: fp32 ZeRO-0 or bf16 ZeRO-1, the two Muon runs under): (the bytes of two fp32 values per
    element of its Muon matrices, Adam's moments there, of which Muon keeps one; the step's largest transient: one
    parameter's update gathered whole over TP beside its shards, fp32, its orthogonalisation and blocks in
    `ns_bytes`, and the Newton-Schulz iteration of its largest matrix, training/muon.py). On the meta device."""
    import torch

    from models.layers import build_layer
    from models.partition import layer_shape
    from models.pipe_layout import DECODER, pipe_layers
    from models.sharding import REPLICA
    from training.muon import layer_plan, pieces

    layers, done, matrices, gathered = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings), {}, 0.0, 0.0
    for index in sorted(held_layers):
        layer = layers[index]
        if layer.kind != DECODER:
            continue
        shape = layer_shape(layer, config)
        if shape not in done:
            with torch.device("meta"):
                module = build_layer(layer, config)
            own, peak = 0.0, 0.0
            for key, p in module.named_parameters():
                if (plan := layer_plan(key, p, config)) is None:
                    continue
                whole = p.numel() / (ep if p.ndim == 3 else 1)  # this rank's experts
                split = plan[0] != REPLICA and tp > 1
                own += whole / tp if split else whole
                piece = max((m.shape for m in pieces(p[0] if p.ndim == 3 else p, *plan)), key=lambda s: s[0] * s[1])
                small, large = sorted(piece)
                # split: on the rank whose round it is, the shards and the whole in fp32, the orthogonal whole and its
                # blocks to scatter in `ns_bytes`
                held = whole * (8 + 2 * ns_bytes) if split else whole * 4
                peak = max(peak, held + (2 * small * large + 2 * small * small) * ns_bytes)
            done[shape] = (own, peak)
        matrices += done[shape][0] * 8
        gathered = max(gathered, done[shape][1])
    return matrices, gathered


def loss_bytes(model, tokens: int, hidden: int, vocab: int, act_bytes: int) -> float:
    """What the last stage's head and loss hold beyond the stage's activations for `tokens` tokens of a micro-batch,
    `vocab` columns a rank (models/loss.py). Fused (`model.fused_head_loss`): kept for backward, the weight's fp32
    gradient when the gradients are taken in forward (`grads_in_forward`; the hidden states' gradient takes the place
    of the head's input, which the stage's activations count), nothing when backward recomputes; at the peak one
    tile's logits in the compute dtype, fp32 and their fp32 softmax.
    Unfused: the logits in the compute dtype and their gradient, and one chunk's fp32 logits and softmax."""
    from models.loss import default_tile, grads_in_forward

    if model.fused_head_loss:
        tile = min(model.loss_chunk_size or default_tile(vocab), tokens)
        kept = vocab * hidden * 4 if grads_in_forward(tokens, hidden, True) else 0
        return kept + tile * vocab * (act_bytes + 8)
    chunk = min(model.loss_chunk_size or tokens, tokens)
    return 2 * tokens * vocab * act_bytes + 2 * chunk * vocab * 4
