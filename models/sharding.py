"""How each weight splits across tensor-parallel ranks, and the pure tensor maths of splitting and merging.

One rule per key (`models.tp_rules.tp_split`), Megatron's split:

    COLUMN  dim 0 in T contiguous blocks   q/k/v (by heads), gate/up (by rows), their biases, LoRA B of those
    ROW     dim 1 in T contiguous blocks   o_proj, down_proj (by input columns), LoRA A of those
    VOCAB   dim 0 of the vocabulary padded to `padded_vocab(V, T, multiple)`, then COLUMN; merged shards lose
            the padding again (rows >= V), so a checkpoint of any T holds the same V real rows
    REPLICA the whole tensor on every rank: norms, row-parallel biases, LoRA A of column layers, LoRA B of row layers
    GATE_UP transformers' fused experts [E, 2I, H] (gate rows, then up rows): each half in T blocks along dim 1,
            a rank holding its gate block then its up block (what a layer file's per-expert COLUMN keys stack to)
    EXPERT_ROW  fused expert down projections [E, H, I]: dim 2 in T contiguous blocks
    GATE_UP_OUT Llama 4's fused experts in x @ W layout [E, H, 2I]: each half in T blocks along dim 2
    EXPERT_IN   Llama 4's fused down projections [E, I, H]: dim 1 in T contiguous blocks
    "parts:a,b,c"  a fused projection whose rows are parts in the proportion a : b : c (`parts_rule`: Phi-3's q/k/v
            in one qkv_proj, heads : KV heads : KV heads; gate and up in one gate_up_proj, 1 : 1): each part in T
            blocks along dim 0, a rank holding its block of each part in order, which is what transformers' layer
            built with heads / T (intermediate / T) holds

Contiguous blocks are `torch.chunk`'s, so these shards are the ones DeepSpeed's universal checkpoint
slices (its loader takes `full.chunk(T, dim)[rank]`). Merging then splitting goes through the whole
tensor, so any degree that divides the heads converts to any other, not only multiples.
"""

from __future__ import annotations

import math

import torch

from models.families import family_of
from models.layer_config import global_attr, layer_attr

COLUMN, ROW, VOCAB, REPLICA = "column", "row", "vocab", "replica"
GATE_UP, EXPERT_ROW = "gate_up", "expert_row"
GATE_UP_OUT, EXPERT_IN = "gate_up_out", "expert_in"
# The dimension a rule splits along (the halves' dimension for the gate-up rules).
_DIM = {COLUMN: 0, ROW: 1, GATE_UP: 1, EXPERT_ROW: 2, GATE_UP_OUT: 2, EXPERT_IN: 1}


TP_DIVIDES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
_OPTIONAL_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp")
# Linear attention's key and value heads (Gated DeltaNet's): split by heads like attention's.
LINEAR_HEADS = ("linear_num_key_heads", "linear_num_value_heads")


def parts_rule(*proportion: int) -> str:
    """The rule of a projection fused from parts whose rows are in `proportion` (dim 0), e.g. q, k, v by heads;
    reduced to lowest terms, so a shard (each part / T, T dividing every head count) splits by the same rule."""
    common = math.gcd(*proportion)
    return "parts:" + ",".join(str(p // common) for p in proportion)


def part_rows(rule: str, rows: int) -> list[int] | None:
    """The rows of each part of a `parts_rule` tensor with `rows` rows (None for any other rule)."""
    if not rule.startswith("parts:"):
        return None
    proportion = [int(p) for p in rule.removeprefix("parts:").split(",")]
    if rows % sum(proportion):
        raise ValueError(f"{rows} rows do not divide into parts {proportion}")
    return [rows // sum(proportion) * p for p in proportion]


def tp_indivisible(config, tp_size: int) -> tuple[str, int] | None:
    """The one rule for a tensor-parallel degree: it must divide the heads, the KV heads (GQA), the MLP widths (the
    experts' and the shared expert's too) and linear attention's heads (not the heads of an attention that stays
    whole on every rank: `Family.replicated_attention`). Returns the first (config field, value) it
    does not divide, or None."""
    experts = [n for n in (*_OPTIONAL_WIDTHS, *LINEAR_HEADS) if getattr(config, n, None)]
    whole = ("num_attention_heads", "num_key_value_heads") if family_of(config).replicated_attention else ()
    for name in (*(n for n in TP_DIVIDES if n not in whole), *experts):
        # each layer's where the config keeps it per layer (Gemma 4's global layers' KV heads)
        values = {global_attr(config, name)} | {layer_attr(config, b, name) for b in range(config.num_hidden_layers)}
        for value in sorted(values):
            if tp_size < 1 or value % tp_size:
                return name, value
    return None


def padded_vocab(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Rows of the embedding and LM head once padded to a multiple of `tp_size` (and of `multiple`)."""
    step = math.lcm(tp_size, max(1, multiple))
    return -(-vocab_size // step) * step


def shard(
    full: torch.Tensor, rule: str, tp_rank: int, tp_size: int, vocab_size: int | None = None, multiple: int = 1
) -> torch.Tensor:
    """This rank's shard of a whole tensor, contiguous and owning its storage (REPLICA: the tensor itself when
    it already is; every other rule: a fresh tensor, so the whole one can be freed)."""
    if rule == REPLICA or (tp_size == 1 and rule != VOCAB):
        return full.contiguous() if full.is_contiguous() else full.clone()
    if (parts := part_rows(rule, full.shape[0])) is not None:
        if any(rows % tp_size for rows in parts):
            raise ValueError(f"parts of {parts} rows do not split into {tp_size} equal shards")
        return torch.cat([part.chunk(tp_size, 0)[tp_rank] for part in full.split(parts, 0)], 0)
    if rule in (GATE_UP, GATE_UP_OUT):
        dim = _DIM[rule]
        gate, up = full.chunk(2, dim)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], dim)
    if rule in (EXPERT_ROW, EXPERT_IN):
        return full.chunk(tp_size, _DIM[rule])[tp_rank].clone()
    if rule == VOCAB:
        rows = padded_vocab(vocab_size, tp_size, multiple)
        full = full[:vocab_size]
        if rows > full.shape[0]:
            full = torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])
        rule = COLUMN
    dim = 0 if rule == COLUMN else 1
    if full.shape[dim] % tp_size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not split into {tp_size} equal shards")
    return full.chunk(tp_size, dim)[tp_rank].clone()


def merge(shards: list[torch.Tensor], rule: str, vocab_size: int | None = None) -> torch.Tensor:
    """The whole tensor from every rank's shard, in rank order (VOCAB: the padding dropped)."""
    if rule == REPLICA or len(shards) == 1 and rule != VOCAB:
        return shards[0]
    if (parts := part_rows(rule, shards[0].shape[0])) is not None:  # each shard holds its block of every part
        pieces = [s.split(parts, 0) for s in shards]
        return torch.cat([piece[i] for i in range(len(parts)) for piece in pieces], 0)
    if rule in (GATE_UP, GATE_UP_OUT):
        dim = _DIM[rule]
        halves = [s.chunk(2, dim) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    if rule in (EXPERT_ROW, EXPERT_IN):
        return torch.cat(shards, _DIM[rule])
    dim = 1 if rule == ROW else 0
    whole = torch.cat(shards, dim) if len(shards) > 1 else shards[0]
    return whole[:vocab_size] if rule == VOCAB else whole


def merged_shape(shapes: list[tuple[int, ...]], rule: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """`merge(...)`'s shape from the shards' shapes alone (no data read)."""
    first = list(shapes[0])
    if rule == REPLICA:
        return tuple(first)
    dim = _DIM.get(rule, 0)  # parts: dimension 0
    first[dim] = vocab_size if rule == VOCAB else sum(s[dim] for s in shapes)
    return tuple(first)
