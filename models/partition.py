"""Which pipeline layers each stage owns: pure maths on the config, no DeepSpeed, no weights.

DeepSpeed's own `partition_method="parameters"` instantiates every layer of the model on every rank
just to count parameters, which for a 70B model means 280 GB of fp32 per rank before training
starts. Here parameters are counted on the meta device, and the balancing is DeepSpeed's own
algorithm (`deepspeed.runtime.utils.partition_balanced`, ported) so the bounds are the ones it
would choose.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from models.key_table import makes_per_layer_inputs
from models.layer_kinds import is_linear_attention, is_sparse_layer
from models.layers import build_layer
from models.moe import experts_per_token, num_experts
from models.pipe_layout import DECODER, LM_HEAD, num_pipe_layers, pipe_layers, stage_bounds_from_blocks

PARTITION_METHODS = ("parameters", "compute", "uniform")


def layer_shape(layer, config) -> tuple:
    """Layers of the same shape have the same parameter count (decoder blocks: sparse or dense, linear attention or
    attention over keys, their attention type, K/V sharing and indexer where layers differ by them (Gemma 4's global
    layers' wider heads, its reusing layers' missing k/v projections, GLM-5's layers without an indexer), block 0
    making the per-layer inputs)."""
    if layer.kind != DECODER:
        return (layer.kind, None)
    block = layer.block
    kinds = [getattr(config, name, None) for name in ("layer_types", "kv_sharing_modes", "indexer_types")]
    own = tuple(k[block] if k else None for k in kinds) + (block == 0 and makes_per_layer_inputs(config),)
    return (layer.kind, is_sparse_layer(config, block), is_linear_attention(config, block), *own)


def layer_param_counts(config, tp=None, active: bool = False, ep: int = 1, experts_only: bool = False) -> list[int]:
    """Parameters per pipeline layer, counted on the meta device (no memory, no init); with `tp` (a
    `models.tensor_parallel.TensorParallel`), one tensor-parallel rank's share. `active`: the parameters one
    token uses (a sparse block's top-k experts of E), the measure of compute. `ep`: one of `expert_parallel_size`
    ranks' share (a sparse block's E / ep experts). `experts_only`: of those, the routed experts' alone (0 for
    other layers)."""
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    sizes = {}
    with torch.device("meta"):
        for layer in layers:
            shape = layer_shape(layer, config)
            if layer.kind != LM_HEAD and shape not in sizes:
                if tp is None:
                    module = build_layer(layer, config)
                else:
                    from models.tensor_parallel import tp_layer_class_and_args

                    cls, args = tp_layer_class_and_args(layer, config, tp)
                    module = cls(*args)
                count = 0 if experts_only else sum(p.numel() for p in module.parameters())
                if (active or ep > 1 or experts_only) and shape[1]:
                    experts = module.moe_block().experts
                    fused = sum(p.numel() for p in experts.parameters())
                    kept = experts_per_token(config) if active else num_experts(config) // ep
                    count += fused * kept // num_experts(config) - (0 if experts_only else fused)
                sizes[shape] = count
    first = layers[0]
    sizes[LM_HEAD, None] = sizes[layer_shape(first, config)]  # the head costs what the embedding costs, tied or not
    return [sizes[layer_shape(layer, config)] for layer in layers]


def balanced_partition(weights: Sequence[float], num_parts: int) -> list[int]:
    """Bounds splitting `weights` into `num_parts` contiguous parts with the smallest max - min part sum.

    DeepSpeed's dynamic programme (The Linear Partition Problem), same tie-breaking, so a stage
    layout computed here equals the one DeepSpeed's "parameters" method picks.
    """
    n, m = len(weights), num_parts
    if n <= m:
        return [min(p, n) for p in range(m + 1)]
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = math.inf
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    dp_max[0][0] = dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                if dp_cost[i][j] >= hi - lo:
                    dp_cost[i][j], dp_max[i][j], dp_min[i][j], position[i][j] = hi - lo, hi, lo, k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


def stage_bounds(config, num_stages: int, partition: str | Sequence[int] = "parameters") -> list[int]:
    """Layer-index bounds of each stage: stage s owns layers [bounds[s], bounds[s+1]).

    Args:
        config: a transformers config of the model.
        num_stages: pipeline stages.
        partition: "parameters" (balance parameter counts: memory), "compute" (balance the parameters a token
            uses: with experts, a sparse block counts its top-k experts of E), "uniform" (decoder blocks spread
            evenly; embedding on the first stage, norm and head on the last), or a list with the
            number of decoder blocks of each stage, e.g. [2, 3, 3, 2].

    Raises:
        ValueError: the partition cannot be honoured; the message names the offending value.
    """
    num_layers = config.num_hidden_layers
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} is larger than the model's {num_layers} decoder layers")
    if isinstance(partition, str):
        if partition in ("parameters", "compute"):
            bounds = balanced_partition(layer_param_counts(config, active=partition == "compute"), num_stages)
            if all(b < e for b, e in zip(bounds[:-1], bounds[1:])) and bounds[-1] == num_pipe_layers(num_layers):
                return [int(b) for b in bounds]
            partition = "uniform"  # NOTE: balancing left a stage empty (huge vocab, few layers)
        if partition != "uniform":
            raise ValueError(f"partition={partition!r}: expected one of {PARTITION_METHODS} or a list of block counts")
        per_stage = [num_layers // num_stages + (s < num_layers % num_stages) for s in range(num_stages)]
    else:
        per_stage = [int(n) for n in partition]
        if len(per_stage) != num_stages:
            raise ValueError(f"partition={per_stage} has {len(per_stage)} entries but num_stages={num_stages}")
        if sum(per_stage) != num_layers or min(per_stage) < 1:
            raise ValueError(
                f"partition={per_stage} must give every stage >= 1 decoder layer and sum to "
                f"num_hidden_layers={num_layers} (sums to {sum(per_stage)})"
            )
    return stage_bounds_from_blocks(per_stage)


def rank_stages(stages: int, num_stages: int, rank: int) -> list[int]:
    """The model stages pipeline rank `rank` holds: its own, and with DualPipeV (2p stages) also stage 2p - 1 - r."""
    return [rank] if stages == num_stages else [rank, stages - 1 - rank]


def rank_layers(bounds: list[int], num_stages: int) -> list[list[int]]:
    """Pipeline layers of each pipeline rank (`rank_stages`)."""
    stages = len(bounds) - 1
    return [
        [i for s in rank_stages(stages, num_stages, r) for i in range(bounds[s], bounds[s + 1])]
        for r in range(num_stages)
    ]
