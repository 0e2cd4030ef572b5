"""What crosses a stage boundary: a declared, ordered set of named tensors (the carry), not a positional tuple.

DeepSpeed's pipeline sends a tuple of tensors from stage to stage (shapes agreed at the first micro-batch) and a
tensor that takes a gradient gets its gradient back by the same path. Every pipeline layer takes such a tuple and
returns one; what each position means after pipeline layer i (its output, the next layer's input) is declared here,
once per model, from its config (`layout`):

    hidden        [B, S, H] float, with a gradient            every model (DeepSeek-V4's N streams: [B, S, N, H])
    position_ids  [B, S] long                                  every model
    lengths       [B] long, where each row's padding starts    models with experts
    stats         [2E + 2] fp32, with a gradient               models with experts (models/moe.py)

and then the tensors the family's layers share across layers (`Family.carries`: the mechanisms below), each from
the layer that makes it to its last reader: a boundary after its last reader no longer sends it, and its gradient
comes back to its maker through the pipeline's own backward wherever the cut falls.

    input_ids         [B, S] long: the tokens, from the embedding to the layers that read them (Gemma 4's per-layer
                      inputs are looked up in block 0)
    per_layer_inputs  Gemma 4's per-layer embeddings (PLE), [B, S, L', P] float with a gradient: made in block 0 from
                      `embed_tokens_per_layer` and a projection of the embeddings (transformers' own methods, on
                      modules block 0 holds), each block taking the first of the L' slices still to come
    kv.<type>.k/.v    Gemma 4's shared keys and values, [B, KV, S, D] float with a gradient: made by the last layer of
                      each attention type that computes its own (`kv_sharing_modes` "store"), read by that type's
                      "reuse" layers
    index.<block>     GLM-5's shared sparse-attention index, [B, S, topk] int32: made by a "full" indexer layer, read
                      by the "shared" layers after it
    input_ids         (as above) DeepSeek-V4's tokens, to the layers whose router picks experts by token id
                      ("hash_moe" in `mlp_layer_types`: a fixed table `tid2eid`), wherever they sit

Carry or recompute (docs/families.md): K/V cost a whole attention projection of an earlier layer's input and PLE the
embedding of every token plus a projection of it (the embedding table lives on the first stage only), so both are
carried; the index is integers (no gradient) and cheap to send.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.families import family_of
from models.layer_config import layer_attr
from models.pipe_layout import decoder_index, num_pipe_layers

INPUT_IDS, PER_LAYER_INPUTS = "input_ids", "per_layer_inputs"


@dataclass(frozen=True)
class Slot:
    """One carried tensor: made by pipeline layer `made_by` (0: the embedding), read by the pipeline layers
    `readers`. It is in the tuple after layers made_by .. last_read - 1 (the layers between pass it on)."""

    name: str
    made_by: int
    readers: tuple[int, ...]

    @property
    def last_read(self) -> int:
        return max(self.readers)


@dataclass(frozen=True)
class Layout:
    """The carry of one model: the tuple's names after each pipeline layer (`names(i)`)."""

    base: tuple[str, ...]
    slots: tuple[Slot, ...]
    norm_index: int

    def names(self, after: int) -> tuple[str, ...]:
        """The names of the tuple pipeline layer `after` returns (the input of layer after + 1)."""
        if not 0 <= after < self.norm_index:
            raise ValueError(f"pipeline layer {after} is past the decoder layers")
        return self.base + tuple(s.name for s in self.slots if s.made_by <= after < s.last_read)

    def unpack(self, after: int, inputs: tuple) -> dict[str, torch.Tensor]:
        """The tuple layer `after` returned, by name."""
        names = self.names(after)
        if len(inputs) != len(names):
            raise ValueError(f"a tuple of {len(inputs)} tensors after pipeline layer {after}, declared {names}")
        return dict(zip(names, inputs, strict=True))

    def pack(self, at: int, state: dict[str, torch.Tensor]) -> tuple:
        """The tuple layer `at` returns: the names alive after it, in their declared order."""
        return tuple(state[name] for name in self.names(at))

    def carried(self, after: int) -> tuple[str, ...]:
        """The family's carried tensors in the tuple after layer `after` (not the base)."""
        return self.names(after)[len(self.base) :]

    def reads(self, block: int) -> tuple[str, ...]:
        """The carried tensors decoder block `block` reads (the others in its input it passes on as they are)."""
        return tuple(s.name for s in self.slots if decoder_index(block) in s.readers)

    def makes(self, block: int) -> tuple[str, ...]:
        """The carried tensors decoder block `block` makes."""
        return tuple(s.name for s in self.slots if s.made_by == decoder_index(block))


def shared_kv_slots(config) -> list[Slot]:
    """Gemma 4's shared K/V: per attention type, its "store" layer's keys and values, read by its "reuse" layers (a
    type no layer reuses carries nothing)."""
    modes = getattr(config, "kv_sharing_modes", None) or []
    slots = []
    for kind in sorted(set(config.layer_types)):
        blocks = [b for b, t in enumerate(config.layer_types) if t == kind]
        store = [b for b in blocks if modes[b] == "store"]
        reuse = [b for b in blocks if modes[b] == "reuse"]
        if store and reuse:
            made, readers = decoder_index(store[0]), tuple(decoder_index(b) for b in reuse)
            slots += [Slot(f"kv.{kind}.k", made, readers), Slot(f"kv.{kind}.v", made, readers)]
    return slots


def shared_index_slots(config) -> list[Slot]:
    """GLM-5's shared sparse-attention index: a "full" indexer layer's top-k, read by the "shared" layers that
    follow it (until the next "full" one)."""
    types, slots = config.indexer_types, []
    for block, kind in enumerate(types):
        if kind != "full":
            continue
        last = block
        while last + 1 < len(types) and types[last + 1] == "shared":
            last += 1
        if last > block:
            readers = tuple(decoder_index(b) for b in range(block + 1, last + 1))
            slots.append(Slot(f"index.{block}", decoder_index(block), readers))
    return slots


def routing_token_slots(config) -> list[Slot]:
    """DeepSeek-V4's hash routing: the tokens, from the embedding to every layer whose router picks experts by token
    id ("hash_moe")."""
    readers = tuple(decoder_index(b) for b, kind in enumerate(config.mlp_layer_types) if kind == "hash_moe")
    return [Slot(INPUT_IDS, 0, readers)] if readers else []


def unread_hub_keys(config) -> list[str]:
    """The hub keys of decoder layers that transformers' model skips at load: Gemma 4's reusing layers keep their own
    k/v projections and norms on the hub (its model builds none: they reuse another layer's K/V). Conversion carries
    them aside, export writes them back (checkpoint/carried.py)."""
    if "shared_kv" not in family_of(config).carries:
        return []
    modes = getattr(config, "kv_sharing_modes", None) or []
    names = ("k_proj", "v_proj", "k_norm", "v_norm")
    return [f"model.layers.{b}.self_attn.{n}." for b, mode in enumerate(modes) if mode == "reuse" for n in names]


def per_layer_input_slots(config) -> list[Slot]:
    """Gemma 4's per-layer inputs: the tokens to block 0, which makes every block's PLE slice; each block reads its
    own, the last block the last one."""
    if not getattr(config, "hidden_size_per_layer_input", 0):
        return []
    blocks = tuple(decoder_index(b) for b in range(config.num_hidden_layers))
    return [Slot(INPUT_IDS, 0, blocks[:1]), Slot(PER_LAYER_INPUTS, blocks[0], blocks[1:] or blocks[:1])]


MECHANISMS = {
    "per_layer_inputs": per_layer_input_slots,
    "shared_kv": shared_kv_slots,
    "shared_index": shared_index_slots,
    "routing_tokens": routing_token_slots,
}


def layout(config) -> Layout:
    """The carry of a model of `config`."""
    family = family_of(config)
    base = ("hidden", "position_ids") + (("lengths", "stats") if family.moe is not None else ())
    slots = tuple(slot for name in family.carries for slot in MECHANISMS[name](config))
    names = [s.name for s in slots]
    if len(set(names)) != len(names):
        raise ValueError(f"{family.model_type}: carried tensors named twice: {names}")
    return Layout(base, slots, num_pipe_layers(config.num_hidden_layers) - 2)


def floating_slots(config) -> int:
    """How many floating tensors with a gradient the busiest boundary sends besides `hidden` (DeepSpeed's pipeline
    partitions a stage's output over TP ranks only where there are none)."""
    lay = layout(config)
    extra = [n for n in lay.base if n == "stats"]
    carried = max(
        (len([n for n in lay.carried(i) if not n.startswith(("index.", INPUT_IDS))]) for i in range(lay.norm_index)),
        default=0,
    )
    return len(extra) + carried


class PerLayerInputs(nn.Module):
    """Gemma 4's per-layer embeddings (PLE), which block 0's layer holds: transformers' own modules under their model's
    names (`embed_tokens_per_layer`, `per_layer_model_projection`, `per_layer_projection_norm`; model-level keys,
    models/key_table.py) and its own methods (`get_per_layer_inputs`, `project_per_layer_inputs` of the family's
    `Model` class), run on this module: [B, S, L, P] from the tokens and their embeddings."""

    def __init__(self, config):
        super().__init__()
        family, hidden, width = family_of(config), config.hidden_size, config.hidden_size_per_layer_input
        layers = config.num_hidden_layers
        self.config, self.hidden_size_per_layer_input = config, width
        self.embed_tokens_per_layer = family.hf_class("ScaledWordEmbedding")(
            config.vocab_size_per_layer_input, layers * width, config.pad_token_id, embed_scale=width**0.5
        )
        self.per_layer_input_scale = 2.0**-0.5
        self.per_layer_model_projection = nn.Linear(hidden, layers * width, bias=False)
        self.per_layer_model_projection_scale = hidden**-0.5
        self.per_layer_projection_norm = family.hf_class("RMSNorm")(width, eps=config.rms_norm_eps)
        self._model = family.hf_class("Model")

    def forward(self, input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        per_layer = self._model.get_per_layer_inputs(self, input_ids, inputs_embeds)  # [B, S, L, P]
        return self._model.project_per_layer_inputs(self, inputs_embeds, per_layer)


# Gemma 4's modules of the per-layer inputs in a decoder layer: block 0's PLE and each layer's gate and projection of
# its slice (replicated under tensor parallelism, outside the split regions).
PER_LAYER_MODULES = ("ple", "per_layer_input_gate", "per_layer_projection")


def per_layer_params(layer: nn.Module) -> list[nn.Parameter]:
    """The trained parameters of a decoder layer's per-layer-input modules (`PER_LAYER_MODULES`)."""
    modules = [getattr(layer, name) for name in PER_LAYER_MODULES if isinstance(getattr(layer, name, None), nn.Module)]
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def stream_mixer_params(layer: nn.Module, config) -> list[nn.Parameter]:
    """The trained parameters of a decoder layer's residual-stream mixers (DeepSeek-V4's `attn_hc` and `ffn_hc`, its
    family's `HyperConnection` modules), which work position by position outside the split regions; none for a
    family without residual streams (`Family.streams`)."""
    family = family_of(config)
    if not family.streams:
        return []
    mixer = family.hf_class("HyperConnection")
    return [p for m in layer.modules() if isinstance(m, mixer) for p in m.parameters() if p.requires_grad]


class LayerCarry:
    """What one decoder block does with the carry: the keyword arguments its transformers layer takes from the
    carried tensors it reads, and the carried tensors it makes (from those arguments, or from the layer's output)."""

    def __init__(self, config, block: int):
        self.layout, self.block = layout(config), block
        self.reads, self.makes = self.layout.reads(block), self.layout.makes(block)
        self.kinds = family_of(config).carries
        self.makes_per_layer_inputs = PER_LAYER_INPUTS in self.makes

    def kwargs(self, layer: nn.Module, hidden: torch.Tensor, carried: dict) -> tuple[dict, dict]:
        """The layer's keyword arguments (per_layer_input, shared_kv_states, prev_topk_indices, input_ids), and what
        `finish` needs besides them (the per-layer inputs still to come)."""
        kwargs, context = {}, {}
        if "per_layer_inputs" in self.kinds and PER_LAYER_INPUTS in self.reads + self.makes:
            if self.block == 0:  # PLE of every block, from the tokens and their embeddings (this layer's input)
                remaining = layer.ple(layer.own_positions(carried[INPUT_IDS]), hidden)
            else:
                remaining = carried[PER_LAYER_INPUTS]  # [B, S, L - block, P]
            kwargs["per_layer_input"], context[PER_LAYER_INPUTS] = remaining[:, :, 0], remaining
        if "shared_kv" in self.kinds:
            from transformers.cache_utils import KVSharingDict

            shared = KVSharingDict()
            for name in self.reads:  # a reusing layer's type's
                if name.startswith("kv.") and name.endswith(".k"):
                    kind = name[3:-2]
                    shared[kind] = carried[name], carried[f"kv.{kind}.v"]
            kwargs["shared_kv_states"] = shared
        if "routing_tokens" in self.kinds and INPUT_IDS in self.reads:  # the whole row, as the experts see (SP too)
            kwargs["input_ids"] = carried[INPUT_IDS]
        if "shared_index" in self.kinds:
            index = [name for name in self.reads if name.startswith("index.")]
            kwargs["prev_topk_indices"] = carried[index[0]] if index else None
        return kwargs, context

    def finish(self, output, kwargs: dict, context: dict) -> tuple[torch.Tensor, dict]:
        """The layer's hidden output and the carried tensors it made."""
        hidden, made = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        out = {}
        for name in self.makes + (PER_LAYER_INPUTS,) * (PER_LAYER_INPUTS in self.reads):
            if name == PER_LAYER_INPUTS:
                out[name] = context[PER_LAYER_INPUTS][:, :, 1:]  # the blocks after this one
            elif name.startswith("kv."):
                kind, part = name[3:].rsplit(".", 1)
                out[name] = kwargs["shared_kv_states"][kind][0 if part == "k" else 1]
            elif name.startswith("index."):
                out[name] = made[0]  # the layer's top-k indices [B, S, topk]
        return hidden, out


def carried_bytes(
    config,
    after: int,
    batch: int,
    seq: int,
    dtype_bytes: int,
    tp: int = 1,
    cp: int = 1,
    sp: bool = False,
    integers: bool = False,
) -> int:
    """Bytes of the floating carried tensors one rank sends after pipeline layer `after` for a micro-batch of
    `batch` rows of `seq` tokens (the hidden states and router statistics aside): the per-layer inputs of the blocks
    still to come for this rank's positions (S/C; S/(C x T) under sequence parallelism `sp`), the shared K/V of
    this TP rank's heads over the CP rank's positions (whole rows under SP: attention's own); with `integers`, also
    the integer ones (the tokens, GLM-5's shared index: int32 [B, S, topk] of the whole row)."""
    total, positions, ints = 0, seq // cp, 0
    for name in layout(config).carried(after):
        if name == PER_LAYER_INPUTS:
            shard = positions // tp if sp else positions
            total += batch * shard * (config.num_hidden_layers - after) * config.hidden_size_per_layer_input
        elif name.startswith("kv."):
            kind = name[3:].rsplit(".", 1)[0]
            store = next(
                b for b, t in enumerate(config.layer_types) if t == kind and config.kv_sharing_modes[b] == "store"
            )
            heads = layer_attr(config, store, "num_key_value_heads") // max(tp, 1)
            total += batch * heads * positions * layer_attr(config, store, "head_dim")
        elif name == INPUT_IDS:
            ints += batch * positions * 8
        elif name.startswith("index."):
            ints += batch * positions * min(config.index_topk, seq) * 4
    return total * dtype_bytes + (ints if integers else 0)


def per_layer_input_bytes(config, batch: int, positions: int, dtype_bytes: int) -> int:
    """Bytes of the per-layer inputs block 0 makes for `positions` of `batch` rows (0 without them)."""
    if not any(s.name == PER_LAYER_INPUTS for s in layout(config).slots):
        return 0
    return batch * positions * config.num_hidden_layers * config.hidden_size_per_layer_input * dtype_bytes


def carried_tensors(
    config, after: int, batch: int, seq: int, shard: int, dtype, tp: int = 1, device="meta"
) -> dict[str, torch.Tensor]:
    """Tensors of the shapes the carry holds after pipeline layer `after` (uninitialised; the planner measures on the
    meta device, tools/activation_bytes.py): `seq` positions of the row, `shard` of them in the hidden states (S/T
    under sequence parallelism), this TP rank's K/V heads."""
    out = {}
    for name in layout(config).carried(after):
        if name == INPUT_IDS:
            out[name] = torch.zeros(batch, seq, dtype=torch.long, device=device)
        elif name == PER_LAYER_INPUTS:
            shape = (batch, shard, config.num_hidden_layers - after, config.hidden_size_per_layer_input)
            out[name] = torch.empty(shape, dtype=dtype, device=device)
        elif name.startswith("kv."):
            kind = name[3:].rsplit(".", 1)[0]
            store = next(
                b for b, t in enumerate(config.layer_types) if t == kind and config.kv_sharing_modes[b] == "store"
            )
            heads = layer_attr(config, store, "num_key_value_heads") // tp
            out[name] = torch.empty(
                batch, heads, seq, layer_attr(config, store, "head_dim"), dtype=dtype, device=device
            )
        elif name.startswith("index."):
            out[name] = torch.zeros(batch, seq, min(config.index_topk, seq), dtype=torch.int32, device=device)
    return out


def stand_ins(config, block: int, batch: int, seq: int, shard: int, dtype, tp: int = 1) -> dict[str, torch.Tensor]:
    """Tensors of the shapes decoder block `block` reads from the carry, on the meta device (`carried_tensors`)."""
    reads = layout(config).reads(block)
    index = decoder_index(block)
    return {k: v for k, v in carried_tensors(config, index - 1, batch, seq, shard, dtype, tp).items() if k in reads}
