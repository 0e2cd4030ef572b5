"""What one decoder block and one pipeline stage keep for backward, in bytes per micro-batch: the planner's
activation model (tools/memory_estimate.py), measured against the tensors autograd saves in
tests/test_memory_estimate.py."""

from __future__ import annotations

import contextlib
import copy
import inspect
import sys

import torch
import torch.nn.functional as F

from models.carry import carried_bytes, per_layer_input_bytes, stand_ins
from models.families import family_of
from models.layer_config import layer_attr
from models.layer_kinds import attention_chunk, is_linear_attention, is_sparse_layer, residual_streams
from models.moe import experts_per_token
from tools import module_bytes
from tools.module_bytes import KeepsInput, stream_head_bytes


def norm_bytes(h: int, act_bytes: int) -> int:
    """Per token, what an RMSNorm saves: its fp32 input, the fp32 1/rms, its normalised output and the
    flattened copy the next matmul saves (both in the compute dtype)."""
    return 4 * h + 4 + 2 * h * act_bytes


def sharded_norm_bytes(h: int, act_bytes: int, shards: int) -> float:
    """`norm_bytes` with sequence parallelism over `shards` TP ranks: the norm's own tensors hold this rank's
    positions, the gathered sequence the next matmul saves holds them all."""
    return (norm_bytes(h, act_bytes) - h * act_bytes) / shards + h * act_bytes


def sparse_mlp_bytes(
    config, tp: int, act_bytes: int, routed: bool = False, gate_bytes: float | None = None, shared_bytes=None
) -> float:
    """Per token, what a sparse block saves (models/moe.py), in place of the dense MLP: for each of its k routed
    copies the gathered row and the expert's output (2h) and what the expert's gate keeps (`gate_bytes`, measured
    by `measured_block_bytes` on the family's own gate: gate/up, act(gate) and down's input, 4 x the expert width
    split over TP, for SwiGLU; more for gpt-oss's clamped one); the router's logits and probabilities and the top-k
    (fp32); a shared expert's four MLP tensors (`shared_bytes`, measured on the family's own: more for DeepSeek-V4's
    clamped SwiGLU) and its gated output. Measured on every family's blocks
    (tests/test_memory_estimate.py). Llama 4's block as transformers runs it runs every expert on every token, so it
    keeps E copies, not k, unless its experts run on their `routed` tokens only (`moe.routed_experts`, or expert
    parallelism)."""
    moe = family_of(config).moe
    experts, k, h = getattr(config, moe.num_experts), experts_per_token(config), config.hidden_size
    width = getattr(config, moe.expert_size)
    copies = experts if moe.scaled_inputs and not routed else k
    gate = 4 * width / tp * act_bytes if gate_bytes is None else gate_bytes
    per_token = copies * (2 * h * act_bytes + gate) + (2 * experts + 2 * k + 10) * 4
    if moe.shared_expert:
        shared = getattr(config, "shared_expert_intermediate_size", None) or width  # Llama 4's: the experts' width
        own = 4 * shared / tp * act_bytes if shared_bytes is None else shared_bytes
        per_token += own + h * act_bytes + 4
    return per_token


def layer_activation_bytes(
    config,
    block: int,
    b: int,
    s: int,
    tp: int,
    act_bytes: int,
    attn: str,
    packed: bool,
    sp: bool = False,
    routed: bool = False,
    row: int | None = None,
    tiled: bool = False,
) -> float:
    """Bytes decoder block `block` keeps for backward per micro-batch (tensors autograd saves, counted once).

    Measured, not modelled: transformers' own block of the family (this TP rank's split of it, `tp` > 1, with
    sequence parallelism when `sp`) runs one row of `s` positions on the meta device (`measured_block_bytes`), so
    every family's norms, q/k norms, fused projections, latent attention and linear-attention recurrence count as
    they are. Three parts stand in for what the meta device cannot run or a GPU runs otherwise, and are counted
    here: attention's kernel keeps q, k, v, its output and the log-sum-exp per head (flash-attn's and SDPA's fused
    kernels; eager attention is the family's own, measured, except under context parallelism, where its
    probabilities count heads x S per token; packed rows add the mask, S per token, where a layer builds it:
    `keeps_mask`); a sparse block's
    experts and router (`sparse_mlp_bytes`); a `tiled` dense MLP (`model.mlp_tiles`) keeps only its input.
    Context parallelism: `s` is this rank's S/C positions of a `row` of S; Ulysses' attention holds all S positions
    of heads / C, the same bytes as S/C positions of every head, but eager's probabilities (heads / C x S x S) and
    the whole row's mask (S x S) grow with the row, not the shard.
    Linear attention counts transformers' pure-torch recurrence (fused kernels keep less)."""
    row = row or s
    heads = config.num_attention_heads
    sparse = is_sparse_layer(config, block)
    eager = attn == "eager" and row == s  # the family's own eager attention, measured (not under CP)
    block_bytes, gate_bytes, shared_bytes = measured_block_bytes(config, block, s, tp, sp, act_bytes, tiled, eager)
    per_token = block_bytes / s
    if sparse:  # a sparse block (`sparse_mlp_bytes`): the experts' and the router's tensors
        per_token += sparse_mlp_bytes(config, tp, act_bytes, routed, gate_bytes, shared_bytes)
    if not is_linear_attention(config, block):
        if attn == "eager" and not eager:
            per_token += heads / tp * row * act_bytes
        if packed and keeps_mask(config, block, attn, row, s):
            per_token += row * (row / s) * act_bytes
        elif packed and attn == "sdpa":  # each document alone (`sdpa_by_document`): the documents' outputs are kept
            head_dim = layer_attr(config, block, "head_dim") or config.hidden_size // heads  # beside the joined one
            per_token += heads / tp * head_dim * act_bytes
    return b * s * per_token


def keeps_mask(config, block: int, attn: str, row: int, s: int) -> bool:
    """Whether decoder block `block` builds the [S, S] mask on packed rows (models/layers.py): eager always; SDPA
    only where a sliding window or chunk shorter than the row bounds it, where the family always takes a mask, or
    under context parallelism (`row` > `s`), else each document is attended alone; flash-attn never."""
    if attn == "flash_attention_2":
        return False
    if attn == "eager" or row != s or family_of(config).always_mask:
        return True
    types = getattr(config, "layer_types", None) or ()
    sliding = family_of(config).window_everywhere or (block < len(types) and types[block] == "sliding_attention")
    window = getattr(config, "sliding_window", None) if sliding else None
    chunk = attention_chunk(config, block)
    return (window is not None and window < row) or (chunk is not None and chunk < row)


def transient_bytes(config, b: int, s: int) -> float:
    """Bytes a decoder block holds only while it runs, beyond what it keeps, where they dwarf it: a lightning
    indexer's scores (DeepSeek-V3.2's, `index_n_heads` in the config) of every key of the row for each query and
    head, in fp32: two at once (the product and its scaled or rectified copy), or with several rows a micro-batch the
    product beside the keys torch's matmul broadcasts to every query ([B, S, head_dim, S]); plus about one [B, S, S]
    of small tensors. Replicated under TP (the indexer is whole on every rank). Measured on transformers' indexer
    against torch's profiler (tests/test_memory_estimate.py). 0 without an indexer."""
    heads = getattr(config, "index_n_heads", None) or 0
    if not heads:
        return 0.0
    keys = config.index_head_dim if b > 1 else 0
    return b * s * s * 4 * (max(2 * heads, heads + keys) + 1)


_MEASURED: dict[tuple, tuple] = {}  # (id(config), ...) -> (the config, kept alive; what it measured)


def measured_block_bytes(
    config, block: int, s: int, tp: int, sp: bool, act_bytes: int, tiled: bool, eager: bool = False
) -> tuple[int, float | None]:
    """(Bytes decoder block `block` of a model of `config` saves for backward on one row of `s` positions, and for
    a sparse block the bytes its experts' gate keeps per routed token), run on the meta device in the compute dtype
    (fp32 or bf16): transformers' block (this rank's TP split of it), with attention's kernel and a sparse block (or
    a tiled MLP) standing in as `layer_activation_bytes` says; `eager`: the family's own eager attention runs instead
    (its probabilities, fp32 softmax copies and GQA's repeated keys and values counted as they are). Cached per
    config and shape: a planner's search asks for the same blocks many times."""
    from models.layers import DecoderOptions, build_layer
    from models.pipe_layout import block_of, pipe_layers
    from models.tensor_parallel import TensorParallel, tp_layer_class_and_args

    key = (id(config), block, s, tp, sp, act_bytes, tiled, eager)
    if key in _MEASURED:
        return _MEASURED[key][1]
    dtype = torch.float32 if act_bytes == 4 else torch.bfloat16
    n = config.num_hidden_layers
    layer = next(x for x in pipe_layers(n, False) if block_of(x.index, n) == block)
    with torch.device("meta"):
        if tp > 1:
            cls, args = tp_layer_class_and_args(layer, config, TensorParallel(tp, 0, sequence_parallel=sp))
            module = cls(*args).to(dtype)
        else:
            module = build_layer(layer, config, DecoderOptions()).to(dtype)
    attention = module.attention()  # (None in a block without attention: linear attention, Mamba, an MLP alone)
    if attention is not None:  # its kernel: the family's eager attention, or what fused kernels keep
        register_fused_kernel()
        attention.config = copy.copy(attention.config)
        attention.config._attn_implementation = "eager" if eager else FUSED_KERNEL
        module.attn_implementation = "eager" if eager else FUSED_KERNEL  # eager: the additive mask built
    moe = family_of(config).moe
    stand_in = is_sparse_layer(config, block) or tiled
    experts = module.moe_block().experts if is_sparse_layer(config, block) else None
    gate_bytes = module_bytes.gate_bytes(experts, dtype) if experts is not None else None
    shared = module.moe_block() if is_sparse_layer(config, block) else None
    names = ("shared_experts", "shared_expert", "shared_mlp")  # DeepSeek's, Qwen's and Llama 4's, Hunyuan's
    shared = next((getattr(shared, n) for n in names if getattr(shared, n, None) is not None), None)
    shared_bytes = module_bytes.mlp_bytes(shared, config.hidden_size, dtype) if shared is not None else None
    shard = s // tp if sp and tp > 1 else s
    streams = (residual_streams(config),) if residual_streams(config) > 1 else ()  # [B, S, N, H]: DeepSeek-V4's
    hidden = torch.empty(1, shard, *streams, config.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    positions = torch.arange(s, device="meta").view(1, s)
    # A sparse block returns its output alone, or with its router's logits (Llama 4's, gpt-oss's): whichever the
    # family's layer takes.
    first = None  # the error of the first try, raised with the second's
    for as_tuple in (False, True) if stand_in else (False,):
        if stand_in and experts is not None and moe.beside_mlp:  # the experts beside a dense MLP (Gemma 4's)
            module.experts = KeepsInput(False, None)
        elif stand_in:
            setattr(module, moe.block if moe is not None else "mlp", KeepsInput(as_tuple, shard))
        # NOTE: the storages of the module's own tensors, taken now: a storage freed with a replaced block may be
        # reused by an activation (on the meta device tensors are told apart by their storage's address).
        # The carried tensors it reads (Gemma 4's K/V and per-layer inputs) are their maker's, or the stage's received
        # input (`stage_activation_bytes` counts them): not this block's.
        carried = stand_ins(config, block, 1, s, shard, dtype, tp)
        held = {t.untyped_storage()._cdata for t in [*module.parameters(), *module.buffers(), *carried.values()]}
        saved: dict[int, int] = {}

        def pack(t, saved=saved, held=held):
            storage = t.untyped_storage()
            if storage._cdata not in held:
                saved[storage._cdata] = storage.nbytes()
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _torch_paths(module):
                module._block(hidden, positions, carried)
            break
        except (TypeError, ValueError) as error:
            if not stand_in:
                raise
            if as_tuple:
                raise error from first
            first = error
    _MEASURED[key] = (config, (sum(saved.values()), gate_bytes, shared_bytes))
    return _MEASURED[key][1]


@contextlib.contextmanager
def _torch_paths(module: torch.nn.Module):
    """Run `module`'s transformers code on its pure-torch functions: where a kernel package is installed (flash-linear-
    attention, causal-conv1d) transformers' modeling module calls it through a wrapper of the torch function, which
    meta tensors cannot enter. The wrapped torch function (`__wrapped__`) stands in while the block is measured; no
    other decorated function is touched."""
    from transformers.integrations import hub_kernels

    wrappers = hub_kernels.__file__  # where transformers' kernel wrappers are defined
    names = {type(m).__module__ for m in module.modules() if type(m).__module__.startswith("transformers.")}
    swapped = []
    for name in names:
        namespace = vars(sys.modules[name])
        for key, value in list(namespace.items()):
            if inspect.isfunction(value) and value.__code__.co_filename == wrappers and hasattr(value, "__wrapped__"):
                swapped.append((namespace, key, value))
                namespace[key] = value.__wrapped__
    try:
        yield
    finally:
        for namespace, key, value in swapped:
            namespace[key] = value


FUSED_KERNEL = "planner_fused_kernel"  # a transformers attention implementation (`register_fused_kernel`)


def register_fused_kernel() -> None:
    """Make FUSED_KERNEL an attention implementation of transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FUSED_KERNEL, _kernel)


def _kernel(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Causal attention keeping for backward what flash-attn and SDPA's fused kernels keep: [B, S, heads, Dv]. For
    the meta device (the planner) and for tests that hold the planner to tensors on the CPU, whose SDPA falls back
    to its math path where query and value heads differ (MLA). Masks other than causal are not applied."""
    return _FusedKernelSaves.apply(query, key, value, scaling), None


class _FusedKernelSaves(torch.autograd.Function):
    """What a fused attention kernel keeps for backward: q, k and v as given (GQA's k and v not repeated), its output
    (which is o_proj's input) and the log-sum-exp per head and position (fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, scaling):
        batch, heads, seq = q.shape[:3]
        if q.is_meta:
            out = q.new_empty(batch, seq, heads, v.shape[-1])
        else:
            groups = heads // k.shape[1]
            keys, values = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scaling)
            out = out.transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, q.new_empty(batch, heads, seq, dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("a stand-in for measuring the memory planner's saved bytes")


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

    n = config.num_hidden_layers

    def own_bytes(block: int) -> float:
        return layer_activation_bytes(config, block, b, s, tp, act_bytes, attn, packed, sp, routed, row, tiled)

    shards = tp if sp else 1  # positions of the residual stream per rank: s / shards
    split_vocab = vocab_parallel(config, TensorParallel(tp, 0, vocab_multiple))
    kept, live = 0.0, 0.0
    kinds = {layer.index: layer.kind for layer in pipe_layers(n, config.tie_word_embeddings)}
    recomputed = [i for i in layers if block_of(i, n) is not None and every and block_of(i, n) % every == 0]
    if recomputed:  # a recomputed block keeps its inputs: the hidden shard and the whole row's position_ids (once)
        kept += b * (row or s) * 8
    # What crosses into the stage and its micro-batch keeps until backward: the carried tensors (models/carry.py);
    # and the per-layer inputs block 0 makes, where it is recomputed (else its own bytes hold them: the later blocks'
    # slices are views of them).
    cp = (row or s) // s
    kept += carried_bytes(config, layers[0] - 1, b, row or s, act_bytes, tp, cp, sp, integers=True) if layers[0] else 0
    kept += per_layer_input_bytes(config, b, s // shards, act_bytes) if 1 in recomputed else 0
    for index in layers:
        block = block_of(index, n)
        own = own_bytes(block) if block is not None else 0.0
        if index in recomputed:
            width = residual_streams(config) * config.hidden_size  # its input: the residual streams
            kept, live = kept + b * s * width * act_bytes / shards, max(live, own)
        elif block is not None:
            kept += own
        elif kinds[index] == NORM:
            # the LM head saves the norm's output, which `norm_bytes` counts (the vocab-parallel head saves none)
            kept += b * s * sharded_norm_bytes(config.hidden_size, act_bytes, shards)
            kept += b * s * stream_head_bytes(config, act_bytes) / shards  # (DeepSeek-V4's streams mixed into one)
        elif kinds[index] == EMBED:
            kept += b * s * (9 if split_vocab else 8)  # token ids (vocab-parallel: this rank's ids and a bool mask)
    return kept, live


# The linear layers of a decoder block: (the tensor that is its input, input width, output width), with TP's split.
def _linear_layers(config, tp: int) -> dict[str, tuple[str, float, float]]:
    h, heads, inter = config.hidden_size, config.num_attention_heads, getattr(config, family_of(config).dense_size)
    # the widest layer's where layers differ in shape (Gemma 4's global layers: wider heads, fewer K/V heads)
    shapes = [(layer_attr(config, b, "head_dim") or h // heads, layer_attr(config, b, "num_key_value_heads"))
              for b in range(config.num_hidden_layers)]  # fmt: skip
    q, kv = heads * max(d for d, _ in shapes) / tp, max(d * n for d, n in shapes) / tp
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
