"""What one decoder block and one pipeline stage keep for backward, in bytes per micro-batch: the planner's
activation model (tools/memory_estimate.py), measured against the tensors autograd saves in
tests/test_memory_estimate.py."""

from __future__ import annotations

from models.families import family_of, is_sparse_layer


def norm_bytes(h: int, act_bytes: int) -> int:
    """Per token, what an RMSNorm saves: its fp32 input, the fp32 1/rms, its normalised output and the
    flattened copy the next matmul saves (both in the compute dtype)."""
    return 4 * h + 4 + 2 * h * act_bytes


def sharded_norm_bytes(h: int, act_bytes: int, shards: int) -> float:
    """`norm_bytes` with sequence parallelism over `shards` TP ranks: the norm's own tensors hold this rank's
    positions, the gathered sequence the next matmul saves holds them all."""
    return (norm_bytes(h, act_bytes) - h * act_bytes) / shards + h * act_bytes


def sparse_mlp_bytes(config, tp: int, act_bytes: int, routed: bool = False) -> float:
    """Per token, what a sparse block saves (models/moe.py), in place of the dense MLP's 4 x intermediate: for each
    of its k routed copies the gathered row and the expert's output (2h) and the expert's gate, up, act(gate) and
    down's input (4 x the expert width, split over TP); the router's logits and probabilities and the top-k
    (fp32); a shared expert's four MLP tensors and its gated output. Measured on Mixtral and Qwen2-MoE blocks
    (tests/test_memory_estimate.py). Llama 4's block as transformers runs it runs every expert on every token, so it
    keeps E copies, not k, unless its experts run on their `routed` tokens only (`moe.routed_experts`, or expert
    parallelism)."""
    moe = family_of(config).moe
    experts, k, h = getattr(config, moe.num_experts), config.num_experts_per_tok, config.hidden_size
    width = getattr(config, moe.expert_size)
    copies = experts if moe.scaled_inputs and not routed else k
    per_token = copies * (2 * h + 4 * width / tp) * act_bytes + (2 * experts + 2 * k + 10) * 4
    if moe.shared_expert:
        shared = getattr(config, "shared_expert_intermediate_size", None) or width  # Llama 4's: the experts' width
        per_token += (4 * shared / tp + h) * act_bytes + 4
    return per_token


def layer_activation_bytes(
    config,
    b: int,
    s: int,
    tp: int,
    act_bytes: int,
    attn: str,
    packed: bool,
    sp: bool = False,
    sparse: bool = False,
    routed: bool = False,
    row: int | None = None,
    tiled: bool = False,
) -> float:
    """Bytes one decoder block keeps for backward per micro-batch (tensors autograd saves, counted once).

    Counted from what the HF LLaMA block saves (tests/test_memory_estimate.py measures it with
    `torch.autograd.graph.saved_tensors_hooks`), per token: each RMSNorm `norm_bytes`; RoPE cos/sin
    2 x head_dim; attention q, k, v after RoPE, the SDPA/flash output rows and o_proj's input:
    2h + 2 x kv_dim, plus the log-sum-exp per head (fp32); SwiGLU gate, up, act(gate) and down's input:
    4 x intermediate (a sparse block: `sparse_mlp_bytes`). Tensor parallelism divides attention and MLP, not the
    norms or RoPE; sequence
    parallelism (`sp`) divides the norms' own tensors too (`sharded_norm_bytes`). Eager
    attention adds the probabilities (heads x S per token); packed rows on SDPA/eager add the mask
    (S per token); flash-attn keeps neither (Korthikanti et al.'s sbh(34 + 5as/h), specialised to LLaMA).
    Context parallelism: `s` is this rank's S/C positions of a `row` of S; Ulysses' attention holds all S positions
    of heads / C, the same bytes as S/C positions of every head, but eager's probabilities (heads / C x S x S) and
    the whole row's mask (S x S) grow with the row, not the shard. A `tiled` dense MLP (`model.mlp_tiles`) keeps
    only its input, which the norm's count already holds.
    """
    row = row or s
    h, heads, inter = config.hidden_size, config.num_attention_heads, getattr(config, family_of(config).dense_size)
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv_dim = config.num_key_value_heads * head_dim
    per_token = 2 * sharded_norm_bytes(h, act_bytes, tp if sp else 1) + 2 * head_dim * act_bytes
    mlp = 0 if sparse or tiled else 4 * inter * act_bytes / tp
    per_token += ((heads * head_dim + h + 2 * kv_dim) * act_bytes + heads * 4) / tp + mlp
    if sparse:  # a sparse block (`sparse_mlp_bytes`): the experts' and the router's tensors
        per_token += sparse_mlp_bytes(config, tp, act_bytes, routed)
    if attn == "eager":
        per_token += heads / tp * row * act_bytes
    if packed and attn != "flash_attention_2":
        per_token += row * (row / s) * act_bytes
    return b * s * per_token


def stage_activation_bytes(
    config,
    layers: range,
    b: int,
    s: int,
    tp: int,
    act_bytes: int,
    attn: str,
    packed: bool,
    every: int,
    sp: bool = False,
    vocab_multiple: int = 1,
    routed: bool = False,
    row: int | None = None,
    tiled: bool = False,
) -> tuple[float, float]:
    """(bytes kept per micro-batch in flight, bytes of the one block being recomputed) for the pipeline layers
    `layers` of a stage; `every`: recompute every k-th block (0: none), keeping only its input. The final
    norm and the LM head's input count on the last stage; the loss's logits are `Estimate.logits`. `sp`: sequence
    parallelism over the `tp` ranks (a recomputed block's input and the final norm hold s / tp positions);
    `vocab_multiple`: `model.vocab_pad_multiple` (a padded vocabulary takes the vocab-parallel embedding and head);
    `routed`: Llama 4's experts run on their routed tokens only (`sparse_mlp_bytes`); `row`: the whole row's length
    when `s` is one context-parallel rank's share of it; `tiled`: dense MLPs run in tiles (`model.mlp_tiles`)."""
    from models.pipe_layout import EMBED, NORM, block_of, pipe_layers
    from models.tensor_parallel import TensorParallel, vocab_parallel

    moe = family_of(config).moe is not None

    n = config.num_hidden_layers
    per_layer = layer_activation_bytes(config, b, s, tp, act_bytes, attn, packed, sp, row=row, tiled=tiled)
    per_sparse = layer_activation_bytes(config, b, s, tp, act_bytes, attn, packed, sp, True, routed, row) if moe else 0
    shards = tp if sp else 1  # positions of the residual stream per rank: s / shards
    split_vocab = vocab_parallel(config, TensorParallel(tp, 0, vocab_multiple))
    kept, live = 0.0, 0.0
    kinds = {layer.index: layer.kind for layer in pipe_layers(n, config.tie_word_embeddings)}
    recomputed = [i for i in layers if block_of(i, n) is not None and every and block_of(i, n) % every == 0]
    if recomputed:  # a recomputed block keeps its inputs: the hidden shard and the whole row's position_ids (once)
        kept += b * (row or s) * 8
    for index in layers:
        block = block_of(index, n)
        own = per_sparse if block is not None and is_sparse_layer(config, block) else per_layer
        if index in recomputed:
            kept, live = kept + b * s * config.hidden_size * act_bytes / shards, max(live, own)
        elif block is not None:
            kept += own
        elif kinds[index] == NORM:
            # the LM head saves the norm's output, which `norm_bytes` counts (the vocab-parallel head saves none)
            kept += b * s * sharded_norm_bytes(config.hidden_size, act_bytes, shards)
        elif kinds[index] == EMBED:
            kept += b * s * (9 if split_vocab else 8)  # token ids (vocab-parallel: this rank's ids and a bool mask)
    return kept, live


# The linear layers of a decoder block: (the tensor that is its input, input width, output width), with TP's split.
def _linear_layers(config, tp: int) -> dict[str, tuple[str, float, float]]:
    h, heads, inter = config.hidden_size, config.num_attention_heads, getattr(config, family_of(config).dense_size)
    head_dim = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * head_dim / tp, config.num_key_value_heads * head_dim / tp
    return {
        "q_proj": ("norm1", h, q),
        "k_proj": ("norm1", h, kv),
        "v_proj": ("norm1", h, kv),
        "o_proj": ("attention", q, h),
        "gate_proj": ("norm2", h, inter / tp),
        "up_proj": ("norm2", h, inter / tp),
        "down_proj": ("act", inter / tp, h),
    }


def deferred_weight_grad_bytes(config, b: int, s: int, tp: int, act_bytes: int, lora_targets=(), r: int = 0) -> float:
    """Bytes the deferred weight gradients of one decoder block hold from its B pass to its W pass (zero_bubble):
    the input of each linear layer (q/k/v share one, gate/up another) and its output gradient. With LoRA only
    the adapters' weights train: the inputs of the targeted layers, A's output and both adapters' output
    gradients (tests/test_memory_estimate.py measures it on the closures the store keeps)."""
    layers = _linear_layers(config, tp)
    if lora_targets:
        chosen = {name: layers[name] for name in lora_targets if name in layers}
        inputs = {key: width for key, width, _ in chosen.values()}
        per_token = sum(inputs.values()) + sum(out + 2 * r for _, _, out in chosen.values())
    else:
        inputs = {key: width for key, width, _ in layers.values()}
        per_token = sum(inputs.values()) + sum(out for _, _, out in layers.values())
    return b * s * per_token * act_bytes
