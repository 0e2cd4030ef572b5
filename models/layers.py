"""Pipeline layers: self-contained modules with a fixed tuple signature, built on each family's transformers
classes (models/families/: the registry, one module per family, dense and mixture-of-experts).

Data flow through one micro-batch (B = micro-batch size, S = sequence length, H = hidden size):

    (input_ids[B,S] long, position_ids[B,S] long)
      -> EmbeddingPipe    -> (hidden[B,S,H], position_ids, + carried)
      -> the family's decoder layer (DecoderPipe) -> (hidden[B,S,H], position_ids, + carried)   x num_hidden_layers
      -> the final norm   -> hidden[B,S,H]      -> LMHeadPipe -> HeadOutput (logits[B,S,V] made by the loss)

What each tuple holds is declared by name (models/carry.py): with experts each row's length (long [B]) and the
router statistics of the sparse layers so far (fp32 [2E + 2], with a gradient; models/moe.py), which the norm hands
on to the head and the loss ((logits, stats)); and the tensors a family's layers share across layers. RoPE cos/sin
and the causal mask are rebuilt inside every decoder layer from the integer `position_ids`: a float mask would need
a gradient, cost B*S*S of traffic and block SDPA/flash.

Packed rows (`data.packing`): several documents share a row and `position_ids` restart at 0 at each
one. Each decoder layer rebuilds the per-document causal mask from them (models/attention_masks.py; flash-attn
gets the equivalent `cu_seqlens`), so attention never crosses a document boundary.

The modules subclass the family's transformers classes so their state_dict keys are the HF suffixes
(models/key_table.py derives them from the same classes), and their maths is HF's own.
"""

from __future__ import annotations

import copy
import functools
import inspect

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from models import context_parallel
from models.attention_masks import (
    DOCUMENT_SDPA,
    attention_mask,
    document_starts,
    flash_varlen_kwargs,
    register_document_attention,
)
from models.carry import INPUT_IDS, LayerCarry, PerLayerInputs, layout
from models.cast import apply_keeping_fp32
from models.decoder_options import DecoderOptions
from models.expert_parallel import ExpertParallel
from models.families import FAMILIES, family_of, resolve_attention
from models.family_classes import has_rope, on_family_class, rotary_class
from models.head import LMHeadPipe, set_logit_rules
from models.hub_parts import part_keys
from models.layer_config import norm_eps, with_torch_dtype
from models.layer_kinds import attends, attention_chunk, is_sparse_layer, residual_streams, sliding_window
from models.moe import (
    DEFAULT_EXPERTS_IMPLEMENTATION,
    add_stats,
    count_chosen,
    dense_mlp,
    empty_stats,
    expert_keys,
    experts_per_token,
    is_moe,
    layer_sums,
    router_of,
    token_mask,
    with_load,
)
from models.pipe_layout import DECODER, EMBED, LM_HEAD, NORM, PipeLayer, decoder_index


def embedding_scale(config) -> float | None:
    """The factor a family multiplies its embeddings by (`Family.scaled_embedding`: sqrt(hidden_size)), or None."""
    return config.hidden_size**0.5 if family_of(config).scaled_embedding else None


class EmbeddingPipe(nn.Embedding):
    """Token embedding. Keys: `weight` = HF `model.embed_tokens.weight`. Also holds what the head of a model with
    tied embeddings needs: the final-logit soft-cap (`config.final_logit_softcapping`)."""

    def __init__(self, config):
        super().__init__(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        embedding_setup(self, config)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        input_ids, *rest = inputs  # [B, S]; position_ids [B, S] (and lengths [B] with experts)
        hidden = super().forward(input_ids)  # [B, S, H]
        return embedded(self, hidden, input_ids, rest)


def embedding_setup(embedding: nn.Module, config) -> None:
    """What an embedding layer keeps besides its weight: the model's experts (their statistics start here), its
    scale or multiplier and the tied head's logit rules, and the carry it starts (models/carry.py)."""
    embedding.moe_config = config if is_moe(config) else None
    embedding.scale = embedding_scale(config)
    field = family_of(config).embedding_multiplier
    embedding.multiplier = getattr(config, field) if field else None
    set_logit_rules(embedding, config)  # the tied head's
    embedding.carry, embedding.streams = layout(config), residual_streams(config)


def embedded(embedding: nn.Module, hidden: torch.Tensor, input_ids: torch.Tensor, rest: list) -> tuple:
    """The embedding's output tuple (models/carry.py): (hidden, position_ids), and with experts each row's length
    and the router statistics of no layer yet; the tokens where a layer reads them."""
    grad = torch.is_grad_enabled()
    if embedding.scale is not None:  # as transformers' scaled embedding: the factor in the weights' dtype
        hidden = hidden * torch.tensor(embedding.scale).to(embedding.weight.dtype)
    if embedding.multiplier is not None:  # muP's (Granite's): a Python float, as transformers multiplies
        hidden = hidden * embedding.multiplier
    if grad and not embedding.weight.requires_grad:
        # NOTE: a frozen embedding (LoRA) still has to hand the next stage a tensor that takes a gradient.
        hidden.requires_grad_()
    if embedding.streams > 1:  # DeepSeek-V4's residual streams: each token's vector N times, [B, S, N, H]
        hidden = hidden.unsqueeze(2).expand(-1, -1, embedding.streams, -1).contiguous()
    state = {"hidden": hidden, "position_ids": rest[0], INPUT_IDS: input_ids}
    if embedding.moe_config is not None:
        # no lengths given: every position is a real token (hidden may hold S/T of them under SP)
        seq = rest[0].shape[-1]
        state["lengths"] = rest[1] if len(rest) > 1 else torch.full(rest[0].shape[:1], seq, device=hidden.device)
        state["stats"] = empty_stats(embedding.moe_config, hidden.device).requires_grad_(grad)
    return embedding.carry.pack(0, state)


class DecoderPipe:
    """Mixin that makes a family's HF decoder block a pipeline layer (see `decoder_layer_class`).

    Keys: the suffixes of HF `model.layers.{b}.*`. Unpacked rows are right-padded and padded positions
    carry ignored labels, so a plain causal mask is exact for every scored token: no padding mask
    needs to cross stages. SDPA and flash-attn get `attention_mask=None` and apply causality themselves
    (their fast path); eager attention gets an additive mask built here. Packed rows on SDPA attend each
    document alone with the causal kernel (`models.attention_masks.sdpa_by_document`: no [S, S] mask); sliding
    windows (Mistral; Qwen2/3 layers marked "sliding_attention") and chunks shorter than the row, and packed rows
    on eager, get an explicit mask; flash-attn gets `cu_seqlens` for packed rows and applies the window itself.
    """

    def __init__(self, config, layer_idx: int, options: DecoderOptions | None = None, ep=None):
        if is_moe(config) and config._experts_implementation is None:  # what transformers' models default to
            config = copy.copy(config)
            config._experts_implementation = DEFAULT_EXPERTS_IMPLEMENTATION
        sparse = is_sparse_layer(config, layer_idx)
        options = options or DecoderOptions()
        # `ep`: a models.expert_parallel.ExpertParallel (this rank's experts; tokens reach them by all-to-all).
        with_torch_dtype(config)  # (Apertus's xIELU makes its parameters in it)
        super().__init__(ep.local_config(config) if sparse and ep else config, layer_idx)
        self.sparse, self.model_config = sparse, config
        part_keys(self, config)  # a tensor the hub keeps in parts (Kimi Linear's short convolutions): its parts' keys
        for path, function in family_of(config).layer_buffers.items():  # what transformers' model attaches to layers
            (owner, name), made = path.rsplit(".", 1), getattr(family_of(config).module(), function)(config)
            self.get_submodule(owner).register_buffer(name, made, persistent=False)
        # Linear attention (Qwen3-Next's Gated DeltaNet) mixes tokens by a recurrence, an MLP-only block not at all:
        # no mask, no keys to attend.
        self.linear = not attends(config, layer_idx)
        self.always_mask = family_of(config).always_mask  # DeepSeek-V3.2's indexer scores against the mask
        for name in family_of(config).frozen:  # run without gradients by transformers (DeepSeek-V3.2's indexer)
            for part in (frozen := self, *name.split("."))[1:]:
                frozen = getattr(frozen, part, None)  # None in a layer without it (GLM-5's shared-index layers)
            if frozen is not None:
                frozen.requires_grad_(False)
        self.moe_block_name = family_of(config).moe.block if sparse else None
        if self.sparse:
            (ep or ExpertParallel()).split(self.moe_block(), config, options.routed_experts)
            self.top_k = experts_per_token(config)
            self.router_logits_at = family_of(config).moe.router_logits
            self.router_choice = family_of(config).moe.router_choice
            router = router_of(self.moe_block(), config)
            router.register_forward_hook(self._keep_router_logits)
            # Its choice steered by a score bias, which `moe.bias_update_rate` moves (not DeepSeek-V4's hash routers)
            self.balanced = self.router_choice and hasattr(router, "e_score_correction_bias")
            expert_keys(self, config, ep)
        self.attn_implementation = config._attn_implementation or resolve_attention(config, None)
        # non-persistent buffers: no keys. None where the family has no RoPE (Nemotron-H's attention).
        self.rotary_emb = rotary_class(family_of(config).model_type)(config) if has_rope(config) else None
        # A rotary embedding with tables per layer type (Gemma's) is called with this layer's type.
        rotary = self.rotary_emb is not None
        takes_type = rotary and "layer_type" in inspect.signature(type(self.rotary_emb).forward).parameters
        self.rotary_args = (config.layer_types[layer_idx],) if takes_type else ()
        tables = getattr(self.rotary_emb, "layer_types", None) or ()
        # Tables by a kind of RoPE other than the layer types (DeepSeek-V4's "main", "compress"): all taken by name.
        self.rotary_kinds = tuple(tables) if takes_type and self.rotary_args[0] not in tables else ()
        self.options = options
        self.recompute = self.options.recompute(layer_idx)
        self.index, self.carry = decoder_index(layer_idx), LayerCarry(config, layer_idx)
        if self.carry.makes_per_layer_inputs:  # Gemma 4's PLE of every block, made here (models/carry.py)
            self.ple = PerLayerInputs(config)
        self.window = None if self.linear else sliding_window(config, self.attention())
        self.chunk = attention_chunk(config, layer_idx)
        self.cp = options.context
        # Packed rows on SDPA: each document attended alone with the causal kernel (models/attention_masks.py), no
        # [S, S] mask; a layer with a window or chunks shorter than the row still takes the mask.
        self.by_document = options.packed and self.attn_implementation == "sdpa" and self.cp.size == 1
        self.by_document = self.by_document and not self.linear and not self.always_mask
        attention = self.attention()
        if self.by_document:
            register_document_attention()
            attention.config = copy.copy(attention.config)
            attention.config._attn_implementation = DOCUMENT_SDPA
        if self.cp.size > 1:  # (refused for linear attention: training/validate.py)
            context_parallel.attach(attention, attention.config, self.cp, self.attn_implementation)
        if options.mlp_tiles > 1 and not sparse:
            context_parallel.tile_mlp(getattr(self, dense_mlp(config)), options.mlp_tiles)

    def packed_mask_reason(self, seq: int) -> str | None:
        """Why this block builds a dense [S, S] mask on packed rows of `seq` positions (None: it builds none; `_block`
        decides by the same window, chunk and `by_document`)."""
        if self.linear or self.attn_implementation == "flash_attention_2":
            return None
        bounds = (("a sliding window", self.window), ("chunked attention", self.chunk))
        bounded = [why for why, size in bounds if size is not None and size < seq]
        if bounded:
            return " and ".join(bounded)
        under_cp = " under context parallelism" if self.cp.size > 1 else ""
        return None if self.by_document else f"{self.attn_implementation} attention{under_cp}"

    def keeps_fp32(self, name: str, dtype) -> bool:
        """What transformers keeps fp32 in `dtype` (`Family.keeps_fp32`), and the RoPE tables of rotary embeddings
        inside the layer (DeepSeek-V4's compressors' own), which transformers computes in fp32."""
        return name.endswith("inv_freq") or family_of(self.model_config).keeps_fp32(name, dtype)

    def own_positions(self, x: torch.Tensor) -> torch.Tensor:
        """The positions of a [B, S, ...] tensor of the whole (CP-local) row that this layer's hidden holds: all."""
        return x

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp32(self, self.keeps_fp32, fn, lambda: super(DecoderPipe, self)._apply(fn, recurse))

    def attention(self) -> nn.Module | None:
        """The attention module of an attention block (`self_attn`; Nemotron-H's `mixer`: `Family.attention`)."""
        return None if self.linear else getattr(self, family_of(self.model_config).attention)

    def moe_block(self) -> nn.Module:
        """The sparse block (`mlp`; Llama 4's `feed_forward`) of a sparse layer; the layer itself where its experts sit
        beside its dense MLP (Gemma 4's)."""
        return getattr(self, self.moe_block_name) if self.moe_block_name else self

    def _keep_router_logits(self, _module, _inputs, outputs) -> None:
        self._router_logits = outputs[self.router_logits_at]  # [B * S, E]
        self._router_choice = outputs[2] if self.router_choice else None  # [B * S, k]: its own choice (DeepSeek's)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # The carry by name (models/carry.py): hidden [B, S, H], position_ids [B, S]; with experts lengths [B] and
        # stats [2E + 2]; and the carried tensors of the family's layers.
        state = self.carry.layout.unpack(self.index - 1, inputs)
        carried = {name: state[name] for name in self.carry.reads}
        args = (state["hidden"], state["position_ids"], state.get("lengths"), carried)
        if self.recompute and torch.is_grad_enabled():
            # Non-reentrant: works with a frozen input (LoRA) and restores the RNG state (dropout) on recompute.
            hidden, stats, made = checkpoint(self._run, *args, use_reentrant=False)
        else:
            hidden, stats, made = self._run(*args)
        state.update(made, hidden=hidden)
        if self.sparse:
            if self.balanced and torch.is_grad_enabled():  # the step's expert loads (models/moe.py `balance`)
                self.expert_counts = count_chosen(stats, getattr(self, "expert_counts", None))
            state["stats"] = add_stats(state["stats"], stats)
        return self.carry.layout.pack(self.index, state)

    def _run(self, hidden, position_ids, lengths, carried: dict):
        """(hidden, the sparse block's router statistics or None, the carried tensors this layer made)."""
        if self.sparse:
            (out, made), stats = self._sparse_block(hidden, position_ids, lengths, carried)
            return out, stats, made
        out, made = self._block(hidden, position_ids, carried)
        return out, None, made

    def _sparse_block(self, hidden: torch.Tensor, position_ids: torch.Tensor, lengths: torch.Tensor, carried: dict):
        """The block's output and its router statistics (models/moe.py), over the row's real tokens. Under context
        parallelism the router saw this rank's S/C positions: the sums are the CP group's (the whole rows'), so
        every rank of the group carries the same statistics to the load-balancing loss."""
        out = self._block(hidden, position_ids, carried)
        logits, self._router_logits = self._router_logits, None
        if family_of(self.model_config).moe.router_probabilities:  # (Gemma 4's router gives them): their log
            logits = logits.clamp_min(torch.finfo(logits.dtype).tiny).log()  # (an underflowed 0: no NaN gradient)
        batch, seq = position_ids.shape
        mask = token_mask(lengths, seq).view(batch, seq)
        mask = context_parallel.shard(mask, self.cp.rank, self.cp.size).reshape(-1)  # this rank's positions
        sums = layer_sums(logits, self.top_k, mask, self._router_choice)
        sums = context_parallel.sum_over_context(sums, self.cp)
        return out, with_load(sums)

    def _block(self, hidden: torch.Tensor, position_ids: torch.Tensor, carried: dict) -> tuple[torch.Tensor, dict]:
        # position_ids: the whole row's; hidden may hold S/T positions (sequence parallel) of this rank's S/C
        # (context parallel), which attention sees: RoPE turns this rank's S/C positions into angles.
        local_positions = context_parallel.shard(position_ids, self.cp.rank, self.cp.size)
        self._batch = hidden.shape[0]  # rows of flattened [B * S, H] tensors (models/tensor_parallel.py `enter`)
        if self.rotary_emb is None or getattr(self.model_config, "position_embedding_type", "rope") != "rope":
            cos_sin = None  # (Granite 4's NoPE model: none)
        elif self.rotary_kinds:  # {kind: (cos, sin)}
            cos_sin = {kind: self.rotary_emb(hidden, local_positions, kind) for kind in self.rotary_kinds}
        else:
            cos_sin = self.rotary_emb(hidden, local_positions, *self.rotary_args)  # 2 x [B, S/C, head_dim]
        packed, seq = self.options.packed, position_ids.shape[-1]
        window = self.window if self.window is not None and self.window < seq else None
        chunk = self.chunk if self.chunk is not None and self.chunk < seq else None
        mask, extra = None, {}
        if self.cp.size > 1:
            attn = self.attention()
            attn.shard_positions = local_positions  # Ulysses reads them (models/context_parallel.py)
            if getattr(attn, "attn_temperature_tuning", False) and not attn.use_rope:  # Llama 4's NoPE layers
                extra["past_key_values"] = context_parallel.ShardOffset(self.cp.rank * (seq // self.cp.size))
        if self.linear:  # rows are right-padded: a causal recurrence never reads the padding into a real position
            pass
        elif self.attn_implementation == "flash_attention_2":
            extra.update(flash_varlen_kwargs(position_ids) if packed else {})
        elif self.by_document and window is None and chunk is None:
            extra["starts"] = document_starts(position_ids)
        elif (
            packed or window is not None or chunk is not None or self.attn_implementation == "eager" or self.always_mask
        ):
            mask = attention_mask(position_ids, packed, window, chunk)
            if self.attn_implementation == "eager":  # additive: 0 where allowed, the dtype's minimum elsewhere
                mask = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device).masked_fill(
                    ~mask, torch.finfo(hidden.dtype).min
                )
            # one per row, as transformers' masks are (a view): DeepSeek-V4's compressors append theirs
            mask = mask.expand(hidden.shape[0], *mask.shape[1:])
        kwargs, context = self.carry.kwargs(self, hidden, carried)  # what it reads of the carry (models/carry.py)
        out = super().forward(
            hidden, attention_mask=mask, position_ids=local_positions, position_embeddings=cos_sin, **extra, **kwargs
        )
        return self.carry.finish(out, kwargs, context)  # (hidden [B, S, H], the carried tensors it made)


def block_index(layer: nn.Module) -> int:
    """The decoder block number of a decoder layer, ours or transformers' own (its token mixer knows it)."""
    if isinstance(getattr(layer, "layer_idx", None), int):  # the layer's own (Nemotron-H's blocks: MLP mixers lack it)
        return layer.layer_idx
    mixers = ("self_attn", "linear_attn", "conv", "mamba")  # (Granite 4's Mamba layers keep `self_attn = None`)
    return next(m for m in (getattr(layer, n, None) for n in mixers) if m is not None).layer_idx


@functools.cache
def decoder_layer_class(model_type: str) -> type[nn.Module]:
    """The pipeline layer of one decoder block of a family: `DecoderPipe` on the family's HF decoder layer."""
    return on_family_class(DecoderPipe, model_type, "DecoderLayer", "DecoderLayerPipe")


class _NormPipe:
    """Mixin: the family's final RMSNorm as a pipeline layer. Keys: `weight` = HF `model.norm.weight` (and with
    residual streams `hc_head.*` = `model.hc_head.*`: the family's `HyperHead`, which mixes the N streams into one
    before the norm, as transformers' model runs it). Drops `position_ids`."""

    def __init__(self, config):
        super().__init__(config.hidden_size, eps=norm_eps(config))
        if residual_streams(config) > 1:
            self.hc_head = FAMILIES[self.model_type].hf_class("HyperHead")(config)

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        hidden, _, *moe = inputs
        if hasattr(self, "hc_head"):  # [B, S, N, H] -> [B, S, H]
            hidden = self.hc_head(hidden)
        return super().forward(hidden) if not moe else (super().forward(hidden), moe[1])

    def keeps_fp32(self, name: str, dtype) -> bool:  # where transformers keeps `model.norm` so (gpt-oss's, in fp16)
        return FAMILIES[self.model_type].keeps_fp32(f"model.{FAMILIES[self.model_type].final_norm}.{name}", dtype)

    def _apply(self, fn, recurse=True):
        return apply_keeping_fp32(self, self.keeps_fp32, fn, lambda: super(_NormPipe, self)._apply(fn, recurse))


@functools.cache
def norm_class(model_type: str) -> type[nn.Module]:
    """The family's final RMSNorm as a pipeline layer (`_NormPipe` on the family's HF RMSNorm)."""
    return on_family_class(_NormPipe, model_type, "RMSNorm", "NormPipe")


def layer_class_and_args(
    layer: PipeLayer, config, options: DecoderOptions | None = None, ep=None
) -> tuple[type[nn.Module], tuple]:
    """The module class of a pipeline layer and its constructor arguments (the one kind -> module table).

    A tied LM head has no module of its own: callers build the embedding's class and apply
    `tied_lm_head_forward` (DeepSpeed's `TiedLayerSpec`).
    """
    family = family_of(config).model_type
    if layer.kind == DECODER:
        return decoder_layer_class(family), (config, layer.block, options, ep)
    cls = {EMBED: EmbeddingPipe, NORM: norm_class(family), LM_HEAD: EmbeddingPipe if not layer.has_file else LMHeadPipe}
    return cls[layer.kind], (config,)


def build_layer(layer: PipeLayer, config, options: DecoderOptions | None = None) -> nn.Module:
    cls, args = layer_class_and_args(layer, config, options)
    return cls(*args)
