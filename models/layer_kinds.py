"""What kind of layer a decoder block is, per the family's config: its attention's window or chunk, whether it mixes
tokens by a recurrence, whether its MLP is sparse, how many residual streams it carries. Read by the model code,
the planner and the checks; below them, above the registry (models/families/)."""

from __future__ import annotations

from models.families import family_of


def sliding_window(config, attention) -> int | None:
    """The window of one layer's attention module (None: full causal attention), as HF applies it."""
    if family_of(config).window_everywhere:
        return getattr(config, "sliding_window", None)
    if getattr(attention, "is_sliding", True) is False:  # EXAONE 4's global layers keep the config's window unused
        return None
    return getattr(attention, "sliding_window", None)


def attention_chunk(config, block: int) -> int | None:
    """The chunk of decoder block `block`'s attention ("chunked_attention" layers: a query attends the keys of its
    own `attention_chunk_size` positions only), or None."""
    types = getattr(config, "layer_types", None)
    if types and types[block] == "chunked_attention":
        return config.attention_chunk_size
    return None


# Layer types (`config.layer_types`) whose token mixer carries a state along the row instead of attending over keys
RECURRENT_TYPES = {"linear_attention": "linear-attention", "conv": "short-convolution"}  # Gated DeltaNet; LFM2's


def is_linear_attention(config, block: int) -> bool:
    """Whether decoder block `block` mixes tokens by a recurrence (`RECURRENT_TYPES`: Qwen3-Next's Gated DeltaNet,
    LFM2's gated short convolution) instead of attention over keys."""
    types = getattr(config, "layer_types", None)
    return bool(types) and types[block] in RECURRENT_TYPES


# Layer types of blocks that hold an MLP and no token mixer (Nemotron-H's one-mixer blocks: a dense MLP, a sparse one)
MLP_ONLY_TYPES = ("mlp", "moe")


def attends(config, block: int) -> bool:
    """Whether decoder block `block` mixes tokens by attention over keys: not by a recurrence (`is_linear_attention`)
    and not an MLP-only block (`MLP_ONLY_TYPES`)."""
    types = getattr(config, "layer_types", None)
    return not is_linear_attention(config, block) and not (types and types[block] in MLP_ONLY_TYPES)


def linear_attention_refusal(config, what: str) -> str | None:
    """Why `what` (packed rows, context parallelism) cannot run a model with recurrent layers, or None."""
    kinds = [config.layer_types[b] for b in range(config.num_hidden_layers) if is_linear_attention(config, b)]
    if not kinds:
        return None
    return (
        f"{what}: {config.model_type}'s {RECURRENT_TYPES[kinds[0]]} layers carry a state along the whole row, which "
        "transformers' torch path neither resets per packed document nor splits over ranks"
    )


def residual_streams(config) -> int:
    """How many residual streams the hidden states hold (`Family.streams`: DeepSeek-V4's `hc_mult`), 1 for most."""
    return int(getattr(config, family_of(config).streams, 1))  # (no config field is named "")


def is_sparse_layer(config, block: int) -> bool:
    """Whether decoder block `block` has a mixture-of-experts MLP (as the family's decoder layer decides)."""
    moe = family_of(config).moe
    if moe is None:
        return False
    if moe.every_layer:
        return True
    if moe.layer_types:  # "dense" / "sparse" (`mlp_layer_types`); Nemotron-H's block types: "moe"
        return getattr(config, moe.layer_types)[block] in ("sparse", "moe")
    if moe.first_dense:
        return block >= getattr(config, moe.first_dense)
    if moe.moe_layers:
        return block in config.moe_layers
    if moe.interval:
        start, end = config.moe_layer_start_index, config.moe_layer_end_index
        return (block + 1) % config.moe_layer_interval == 0 and start <= block <= end
    return (
        block not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (block + 1) % config.decoder_sparse_step == 0
    )
