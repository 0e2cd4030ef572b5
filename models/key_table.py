"""The one table of key names: pipeline layer (models/pipe_layout.py) <-> Hugging Face keys, both directions.

Every converter, loader and test goes through this module; nothing else knows hub key names. For a model with L
decoder layers the pipeline layers are:

    index 0          embedding         model.embed_tokens.weight
    index 1 .. L     decoder block b   model.layers.{b}.*           (index = b + 1)
    index L + 1      final RMSNorm     model.norm.weight
    index L + 2      LM head           lm_head.weight

With tied input/output embeddings the LM head is a second use of layer 0's module (DeepSpeed
`TiedLayerSpec`): it has no file of its own and `lm_head.weight` maps to layer 0's `weight`.
"""

from __future__ import annotations

import functools
import json
import re

from models.carry import unread_hub_keys
from models.families import DEFAULT_MODEL_TYPE, FAMILIES, family_of
from models.hub_names import hub_key
from models.layer_config import with_torch_dtype
from models.layer_kinds import is_linear_attention, is_sparse_layer, residual_streams
from models.pipe_layout import DECODER, EMBED, LM_HEAD, NORM, PipeLayer, pipe_layers

DECODER_PREFIX = "model.layers.{}."  # HF name of decoder block {} (the module; its keys follow)

# kind -> {key inside our layer module: HF key template}. "{}" stands for the decoder block number. A decoder
# block's keys are derived from transformers' own layer (`decoder_keys`); the DECODER entries below are the linear
# layers and norms LoRA and tensor parallelism know by name across the families (`linear_modules`).
KEY_TABLE: dict[str, dict[str, str]] = {
    EMBED: {"weight": "model.embed_tokens.weight"},
    DECODER: {
        "self_attn.q_proj.weight": "model.layers.{}.self_attn.q_proj.weight",
        "self_attn.k_proj.weight": "model.layers.{}.self_attn.k_proj.weight",
        "self_attn.v_proj.weight": "model.layers.{}.self_attn.v_proj.weight",
        "self_attn.o_proj.weight": "model.layers.{}.self_attn.o_proj.weight",
        "mlp.gate_proj.weight": "model.layers.{}.mlp.gate_proj.weight",
        "mlp.up_proj.weight": "model.layers.{}.mlp.up_proj.weight",
        "mlp.down_proj.weight": "model.layers.{}.mlp.down_proj.weight",
        # Present only where the family's `qkv_bias`, `o_bias`, `mlp_bias` say (models/families/).
        "self_attn.q_proj.bias": "model.layers.{}.self_attn.q_proj.bias",
        "self_attn.k_proj.bias": "model.layers.{}.self_attn.k_proj.bias",
        "self_attn.v_proj.bias": "model.layers.{}.self_attn.v_proj.bias",
        "self_attn.o_proj.bias": "model.layers.{}.self_attn.o_proj.bias",
        "mlp.gate_proj.bias": "model.layers.{}.mlp.gate_proj.bias",
        "mlp.up_proj.bias": "model.layers.{}.mlp.up_proj.bias",
        "mlp.down_proj.bias": "model.layers.{}.mlp.down_proj.bias",
        # Qwen3: RMSNorm over head_dim on queries and keys.
        "self_attn.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
        "self_attn.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
        # Fused projections (`Family.fused_qkv`, `fused_gate_up`) in place of q/k/v or of gate and up.
        "self_attn.qkv_proj.weight": "model.layers.{}.self_attn.qkv_proj.weight",
        "mlp.gate_up_proj.weight": "model.layers.{}.mlp.gate_up_proj.weight",
    },
    NORM: {"weight": "model.norm.weight"},
    LM_HEAD: {"weight": "lm_head.weight"},
}
# The decoder layers' RMSNorms, every registered family's (`Family.norms`: input_layernorm, post_attention_layernorm;
# Gemma's four); each layer has its family's only.
_NORMS = {f"{n}.weight" for family in FAMILIES.values() for n in family.norms}
KEY_TABLE[DECODER] |= {key: "model.layers.{}." + key for key in sorted(_NORMS)}

# Mixture-of-experts blocks (models/families/ `MoeSpec`): our layer files keep the hub's keys, one per expert
# ("{e}" stands for the expert number), and models/moe.py stacks them into transformers' fused in-memory
# parameters at load (and back at save). {hub_block}: the family's `MoeSpec.hub_block`.
MOE_KEYS: dict[str, str] = {
    "router": "{hub_block}.gate.weight",
    "gate": "{hub_block}.experts.{e}.{gate}.weight",
    "up": "{hub_block}.experts.{e}.{up}.weight",
    "down": "{hub_block}.experts.{e}.{down}.weight",
}
# `MoeSpec.hub_fused`: the hub keeps each layer's experts fused as transformers keeps them in memory.
FUSED_MOE_KEYS: dict[str, str] = {
    "router": "{block}.{router}.weight",
    "gate_up": "{block}.experts.gate_up_proj",  # x @ W [E, H, 2I] (Llama 4, gpt-oss) or [E, 2I, H] (Mistral 4)
    "down": "{block}.experts.down_proj",  # [E, I, H] or [E, H, I]
}
# Model-level tensors a decoder block's layer holds: Gemma 4's per-layer embeddings (PLE), made in block 0 and
# carried to every later block (models/carry.py `PerLayerInputs`, under these names).
PER_LAYER_INPUT_KEYS: dict[str, str] = {
    f"ple.{name}.weight": f"model.{name}.weight"
    for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm")
}
# HF keys that hold no weights (old checkpoints saved RoPE buffers): dropped on import.
DROPPED_HF_KEYS: tuple[str, ...] = ("model.layers.{}.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq")
_DROP_PATTERNS = [re.compile("^" + re.escape(t).replace(r"\{\}", r"\d+") + "$") for t in DROPPED_HF_KEYS]

MOE_SPECS = [family.moe for family in FAMILIES.values() if family.moe is not None]  # every registered family's


def alternatives(names) -> str:
    """A regular expression matching any of `names` exactly (sorted, escaped)."""
    return "(?:" + "|".join(re.escape(n) for n in sorted(set(names))) + ")"


def moe_key(config, part: str, expert: int | None = None) -> str:
    """Our (and the hub's, below `model.layers.N.`) key of a sparse block's router or of one expert's projection
    (`part`: "router", "gate", "up" or "down"; with fused hub experts "router", "gate_up" or "down", no expert)."""
    moe = family_of(config).moe
    if moe.hub_fused:
        return FUSED_MOE_KEYS[part].format(block=moe.block, router=moe.router)
    gate, up, down = moe.expert_names
    return MOE_KEYS[part].format(hub_block=moe.hub_block, e=expert, gate=gate, up=up, down=down)


def expert_parts(config) -> dict[str, tuple[str, ...]]:
    """{fused in-memory parameter of a sparse block's experts (under `experts.`): the hub parts of each expert it
    holds}: gate rows then up rows in `gate_up_proj`; gateless experts (`MoeSpec.expert_names` without a gate:
    Nemotron-H's) hold `up_proj` alone."""
    gated = bool(family_of(config).moe.expert_names[0])
    return {"gate_up_proj" if gated else "up_proj": ("gate", "up") if gated else ("up",), "down_proj": ("down",)}


@functools.cache
def _hub_parts(model_type: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter

    found = []
    for t in get_checkpoint_conversion_mapping(model_type) or []:
        if not isinstance(t, WeightConverter) or len(t.target_patterns) != 1 or len(t.operations) != 1:
            continue
        plain = all(re.fullmatch(r"[\w.]+", p) for p in (*t.source_patterns, *t.target_patterns))  # no pattern
        if plain and isinstance(t.operations[0], Concatenate) and t.operations[0].dim == 0:
            found.append((t.target_patterns[0], tuple(t.source_patterns)))
    return tuple(found)


def hub_parts(config) -> dict[str, tuple[str, ...]]:
    """{a decoder layer's in-memory key: the hub keys (in the layer) it is concatenated from along dim 0, in order}:
    transformers' conversion mapping's plain concatenations (Kimi Linear's `self_attn.q_conv1d.weight`, `k_conv1d`,
    `v_conv1d` -> `self_attn.conv1d.weight`), which our layer files keep apart as the hub does (models/hub_parts.py
    splits and joins the tensors); empty for most families."""
    return dict(_hub_parts(family_of(config).model_type))


def _hub_names(config, keys: list[str], sparse: bool) -> list[str]:
    """Our layer-file keys of a decoder block from the names of transformers' layer: a tensor the hub keeps in parts
    becomes its parts' keys (`hub_parts`), a sparse block's fused experts the hub's per-expert keys
    (`MoeSpec.hub_fused`: kept fused) and its router weight the hub's name for it (what models/moe.py `expert_keys`
    does to the tensors)."""
    parts = hub_parts(config)
    keys = [part for key in keys for part in parts.get(key, (key,))]
    moe = family_of(config).moe
    if not sparse or moe.hub_fused:
        return keys
    experts = getattr(config, moe.num_experts)
    parts = expert_parts(config)  # each expert's keys in the hub's order, where the first fused parameter sits
    ordered = tuple(part for held in parts.values() for part in held)
    fused = {f"{moe.block}.experts.{name}": ordered if i == 0 else () for i, name in enumerate(parts)}
    out = []
    for key in keys:
        if key in fused:
            out += [moe_key(config, part, e) for e in range(experts) for part in fused[key]]
        elif key == f"{moe.block}.{moe.router}.weight":
            out.append(moe_key(config, "router"))
        else:
            out.append(key)
    return out


def decoder_keys(config, block: int) -> list[str]:
    """Our keys of decoder block `block`: the state-dict keys of the family's own transformers decoder layer built
    for it on the meta device (saved buffers included, e.g. a router's `e_score_correction_bias`), with a sparse
    block's experts under the hub's keys. Derived, not declared: what transformers' layer has is what a layer
    file holds (tests/test_families.py holds them to `save_pretrained`'s keys)."""
    return _hub_names(config, list(_meta_layer(config, block)[0]), is_sparse_layer(config, block))


def decoder_buffers(config, block: int) -> set[str]:
    """The keys of decoder block `block` that are saved buffers, not parameters (DeepSeek's router score bias): no
    optimizer state, so layout moves of optimizer state leave them out."""
    return set(_meta_layer(config, block)[1])


_META_LAYERS: dict[tuple, tuple[tuple[str, ...], frozenset[str]]] = {}


def _meta_layer(config, block: int) -> tuple[tuple[str, ...], frozenset[str]]:
    """(state-dict keys, buffer names) of the family's transformers decoder layer for `block`, built on the meta
    device once per config contents and block: an engine's build asks for every block's more than once
    (`checkpoint/universal.py universal_info`: 61 DeepSeek-V3 layers with 256 experts each, 1.9 s built twice)."""
    import torch

    contents = _config_contents(config)
    key = None if contents is None else (f"{type(config).__module__}.{type(config).__qualname__}", contents, block)
    if key is None or key not in _META_LAYERS:
        with torch.device("meta"):
            layer = family_of(config).hf_class("DecoderLayer")(with_torch_dtype(config), block)
        names = (tuple(layer.state_dict()), frozenset(name for name, _ in layer.named_buffers()))
        if key is None:
            return names
        if len(_META_LAYERS) > 4096:  # a process that sees many configs (the tests): keep memory bounded
            _META_LAYERS.clear()
        _META_LAYERS[key] = names
    return _META_LAYERS[key]


def _config_contents(config) -> str | None:
    """Everything `config` holds, as JSON: its attributes directly (24-50 us for the tiny families' configs;
    `to_json_string` deep-copies and took 170-330 us, and an engine build asks thousands of times in the parity
    tests), transformers' own serialisation where an attribute is a nested config or another object; None where
    neither can say it (never cached)."""
    import torch

    def plain(value):
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, (set, frozenset)):  # e.g. `ignore_keys_at_rope_validation`
            return sorted(value, key=repr)
        raise TypeError(type(value).__name__)

    try:
        return json.dumps(vars(config), sort_keys=True, default=plain)  # the private implementation choices too
    except (TypeError, ValueError):
        pass
    try:
        private = [str(config.__dict__.get(f"_{n}_implementation_internal")) for n in ("attn", "experts")]
        return json.dumps([config.to_json_string(use_diff=False), private])
    except (TypeError, ValueError):
        return None


def layer_keys(layer: PipeLayer, config) -> dict[str, str]:
    """{our key: HF key} for one layer file, given a transformers config of a supported family."""
    if not layer.has_file:
        return {}
    if layer.kind == DECODER:
        keys = {ours: DECODER_PREFIX.format(layer.block) + ours for ours in decoder_keys(config, layer.block)}
        keys |= PER_LAYER_INPUT_KEYS if layer.block == 0 and makes_per_layer_inputs(config) else {}
    else:
        keys = dict(KEY_TABLE[layer.kind])
        if layer.kind == NORM:  # `model.norm`, or the family's own name for it (LFM2's `model.embedding_norm`)
            keys = {"weight": f"model.{family_of(config).final_norm}.weight"}
        if layer.kind == EMBED:  # `model.embed_tokens`, or the family's own name for it (`model.embeddings`)
            keys = {"weight": f"model.{family_of(config).embedding}.weight"}
        if layer.kind == NORM and residual_streams(config) > 1:  # the streams' head, which the norm's layer runs
            keys |= {f"hc_head.{k}": f"model.hc_head.{k}" for k in _stream_head_keys(config)}
    if family_of(config).hub_renames:
        return {ours: hub_key(config, hf) for ours, hf in keys.items()}
    return keys


def _stream_head_keys(config) -> list[str]:
    """The keys of the family's `HyperHead` (DeepSeek-V4's: `hc_fn`, `hc_base`, `hc_scale`), from transformers' own."""
    import torch

    with torch.device("meta"):
        return list(family_of(config).hf_class("HyperHead")(config).state_dict())


def makes_per_layer_inputs(config) -> bool:
    """Whether the model has per-layer inputs (Gemma 4's PLE), which decoder block 0's layer makes and holds."""
    return "per_layer_inputs" in family_of(config).carries and bool(getattr(config, "hidden_size_per_layer_input", 0))


# The config field counting the multi-token-prediction layers a hub checkpoint keeps after the last decoder layer
# (`model.layers.{L}..{L + n - 1}.*`: DeepSeek-V3's, GLM-4.5's), which transformers' models do not run.
MTP_LAYERS_FIELD = "num_nextn_predict_layers"


def is_carried(hf_key: str, config) -> bool:
    """Whether `hf_key` is a hub tensor the model carries without training it: a multi-token-prediction layer after
    the last decoder layer, or a tensor transformers' own model skips at load (`_keys_to_ignore_on_load_unexpected`
    of the family's PreTrainedModel: Qwen3-Next's `mtp.*`). Conversion keeps it aside as it is and export writes it
    back (checkpoint/carried.py)."""
    block = re.match(r"model\.layers\.(\d+)\.", hf_key)
    extra = getattr(config, MTP_LAYERS_FIELD, 0) or 0
    if block and config.num_hidden_layers <= int(block.group(1)) < config.num_hidden_layers + extra:
        return True
    if block:  # transformers' patterns name the released models' layer numbers; a decoder layer's own unread keys
        return hf_key.startswith(tuple(unread_hub_keys(config)))
    return any(re.search(p, hf_key) for p in family_of(config).ignored_on_load())


def hub_index(config) -> dict[str, tuple[int, str]]:
    """{HF key: (pipeline layer index, our key)} of every tensor of the model (`all_layer_keys` inverted)."""
    return {hf: (index, ours) for index, keys in all_layer_keys(config).items() for ours, hf in keys.items()}


def hf_key_to_layer(hf_key: str, config, index: dict[str, tuple[int, str]] | None = None) -> tuple[int, str] | None:
    """Map an HF key to (pipeline layer index, our key), or None for keys to drop (saved RoPE tables; the tied
    LM head, whose weight is the embedding's). `index`: `hub_index(config)`, when the caller maps many keys.

    Raises:
        KeyError: the key is no tensor of the model (another architecture, or a block number beyond
            `num_hidden_layers`).
    """
    if any(p.match(hf_key) for p in _DROP_PATTERNS):
        return None
    if hf_key == hub_key(config, KEY_TABLE[LM_HEAD]["weight"]) and config.tie_word_embeddings:
        return None
    found = (index if index is not None else hub_index(config)).get(hf_key)
    if found is not None:
        return found
    block = re.match(r"model\.layers\.(\d+)\.", hf_key)
    if block and int(block.group(1)) >= config.num_hidden_layers:
        raise KeyError(f"{hf_key}: block {block.group(1)} >= num_hidden_layers={config.num_hidden_layers}")
    model_type = getattr(config, "model_type", None) or DEFAULT_MODEL_TYPE
    raise KeyError(f"{hf_key}: not a key of a {model_type} model of this config (models/key_table.py)")


def linear_modules(config=None) -> list[str]:
    """The linear layers of a decoder block, as named inside it ("self_attn.q_proj", ...): what LoRA can adapt.
    With a dense model's `config`, its family's only, in a block of each token mixer it has (attention, linear
    attention, short convolution): the modules of exactly `nn.Linear`'s maths in transformers' layer (fused
    projections: `qkv_proj`, `gate_up_proj`; LFM2's `feed_forward.w1`); else the names every family shares."""
    if config is None:
        return [k.removesuffix(".weight") for k in KEY_TABLE[DECODER] if k.endswith("_proj.weight")]
    blocks = {is_linear_attention(config, b): b for b in reversed(range(config.num_hidden_layers))}
    names = []
    for block in sorted(blocks.values()):
        names += [n for n in linear_layers(config, block) if n not in names]
    return names


def linear_layers(config, block: int) -> list[str]:
    """The modules of exactly `nn.Linear`'s maths in the family's transformers layer for decoder block `block`, as
    named in it (built on the meta device): not other maths that subclasses nn.Linear (DeepSeek-V4's grouped
    `o_a_proj`, which PEFT's adapter would treat as one matrix)."""
    import torch
    from torch import nn

    with torch.device("meta"):
        layer = family_of(config).hf_class("DecoderLayer")(with_torch_dtype(config), block)
    return [n for n, m in layer.named_modules() if n and type(m).forward is nn.Linear.forward]


def hf_decoder_module(block: int, module: str) -> str:
    """HF name of a module of decoder block `block`: (3, "self_attn.q_proj") -> "model.layers.3.self_attn.q_proj"."""
    return DECODER_PREFIX.format(block) + module


def all_layer_keys(config) -> dict[int, dict[str, str]]:
    """{layer index: {our key: HF key}} for every layer that has a file."""
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    return {layer.index: layer_keys(layer, config) for layer in layers if layer.has_file}
