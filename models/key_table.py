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

import re

from models.families import FAMILIES, family_of, is_sparse_layer
from models.pipe_layout import DECODER, EMBED, LM_HEAD, NORM, PipeLayer, decoder_index, pipe_layers

DECODER_PREFIX = "model.layers.{}."  # HF name of decoder block {} (the module; its keys follow)

# kind -> {key inside our layer module: HF key template}. "{}" stands for the decoder block number.
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

# Mixture-of-experts blocks (models/families.py `MoeSpec`): our layer files keep the hub's keys, one per expert
# ("{e}" stands for the expert number), and models/moe.py stacks them into transformers' fused in-memory
# parameters at load (and back at save). {hub_block}: the family's `MoeSpec.hub_block`.
MOE_KEYS: dict[str, str] = {
    "router": "{hub_block}.gate.weight",
    "gate": "{hub_block}.experts.{e}.{gate}.weight",
    "up": "{hub_block}.experts.{e}.{up}.weight",
    "down": "{hub_block}.experts.{e}.{down}.weight",
}
# `MoeSpec.hub_fused`: the hub keeps each layer's experts fused as transformers does, in x @ W layout.
FUSED_MOE_KEYS: dict[str, str] = {
    "router": "{block}.router.weight",
    "gate_up": "{block}.experts.gate_up_proj",  # [E, H, 2I]: gate columns, then up columns
    "down": "{block}.experts.down_proj",  # [E, I, H]
}
SHARED_EXPERT_KEYS = (
    "{block}.shared_expert.gate_proj.weight",
    "{block}.shared_expert.up_proj.weight",
    "{block}.shared_expert.down_proj.weight",
)
SHARED_EXPERT_GATE_KEY = "{block}.shared_expert_gate.weight"  # Qwen2-MoE's sigmoid gate
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")

# HF keys that hold no weights (old checkpoints saved RoPE buffers): dropped on import.
DROPPED_HF_KEYS: tuple[str, ...] = ("model.layers.{}.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq")

_QKV_BIAS = {f"self_attn.{p}_proj.bias" for p in "qkv"}
_O_BIAS = {"self_attn.o_proj.bias"}
_MLP_BIAS = {k for k in KEY_TABLE[DECODER] if k.startswith("mlp.") and k.endswith(".bias")}
_QK_NORM = {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}


_SPLIT_QKV, _FUSED_QKV = {f"self_attn.{p}_proj.weight" for p in "qkv"}, {"self_attn.qkv_proj.weight"}
_FUSED_GATE_UP = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def _optional_keys(config) -> set[str]:
    """The optional decoder keys a model has, by its family (models/families/) and config."""
    family = family_of(config)
    keys = set(_FUSED_QKV if family.fused_qkv else _SPLIT_QKV)
    for present, optional in ((family.qkv_bias, _QKV_BIAS), (family.o_bias, _O_BIAS), (family.mlp_bias, _MLP_BIAS)):
        keys |= optional if family.has(present, config) else set()
    if family.qk_norm:
        keys |= _QK_NORM
    return keys | {f"{n}.weight" for n in family.norms}


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{\}", r"(\d+)") + "$")


def moe_key(config, part: str, expert: int | None = None) -> str:
    """Our (and the hub's, below `model.layers.N.`) key of a sparse block's router or of one expert's projection
    (`part`: "router", "gate", "up" or "down"; with fused hub experts "router", "gate_up" or "down", no expert)."""
    moe = family_of(config).moe
    if moe.hub_fused:
        return FUSED_MOE_KEYS[part].format(block=moe.block)
    gate, up, down = moe.expert_names
    return MOE_KEYS[part].format(hub_block=moe.hub_block, e=expert, gate=gate, up=up, down=down)


def sparse_block_keys(config) -> list[str]:
    """Our keys of one sparse MLP block: the router, each expert's gate, up and down (or the fused experts), the
    shared expert (and its gate)."""
    moe = family_of(config).moe
    if moe.hub_fused:
        keys = [moe_key(config, part) for part in FUSED_MOE_KEYS]
    else:
        experts = getattr(config, moe.num_experts)
        keys = [moe_key(config, "router")]
        keys += [moe_key(config, part, e) for e in range(experts) for part in ("gate", "up", "down")]
    if moe.shared_expert:
        keys += [k.format(block=moe.block) for k in SHARED_EXPERT_KEYS]
        keys += [SHARED_EXPERT_GATE_KEY.format(block=moe.block)] if moe.shared_gate else []
    return keys


def dense_mlp_keys(config) -> tuple[str, ...]:
    """Our keys of a dense MLP in a decoder layer (`mlp.*`; Llama 4's `feed_forward.*`)."""
    family = family_of(config)
    if family.fused_gate_up:
        return _FUSED_GATE_UP
    block = family.moe.block if family.moe is not None else "mlp"
    return tuple(block + k.removeprefix("mlp") for k in _DENSE_MLP)


MOE_SPECS = [family.moe for family in FAMILIES.values() if family.moe is not None]  # every registered family's


def alternatives(names) -> str:
    """A regular expression matching any of `names` exactly (sorted, escaped)."""
    return "(?:" + "|".join(re.escape(n) for n in sorted(set(names))) + ")"


def _moe_patterns() -> list[re.Pattern]:
    """Every registered family's sparse-layer keys on the hub (models/families/): per-expert projections and their
    router, fused experts and their router, shared experts, and the dense MLP of a family whose block has another
    name than `mlp`. Any block number, any expert number; `hf_key_to_layer` checks the block against the model."""
    per_expert = [m for m in MOE_SPECS if not m.hub_fused]
    fused = [m for m in MOE_SPECS if m.hub_fused]
    bodies = []
    if per_expert:
        hub = alternatives(m.hub_block for m in per_expert)
        names = alternatives(n for m in per_expert for n in m.expert_names)
        bodies += [hub + r"\.gate\.weight", hub + r"\.experts\.\d+\." + names + r"\.weight"]
    if fused:
        block = alternatives(m.block for m in fused)
        routers = alternatives(m.router for m in fused)
        bodies += [block + r"\.experts\.(?:gate_up|down)_proj", block + r"\." + routers + r"\.weight"]
    shared = [m for m in MOE_SPECS if m.shared_expert]
    if shared:
        shared_keys = r"\.shared_expert(?:\.(?:gate|up|down)_proj|_gate)\.weight"
        bodies.append(alternatives(m.block for m in shared) + shared_keys)
    renamed = [m.block for m in MOE_SPECS if m.block != "mlp"]
    if renamed:
        bodies.append(alternatives(renamed) + r"\.(?:gate|up|down)_proj\.weight")
    return [re.compile(r"^model\.layers\.(\d+)\.(" + body + ")$") for body in bodies]


_HF_PATTERNS = [(kind, ours, _template_regex(tpl)) for kind, keys in KEY_TABLE.items() for ours, tpl in keys.items()]
_MOE_PATTERNS = _moe_patterns()
_DROP_PATTERNS = [_template_regex(tpl) for tpl in DROPPED_HF_KEYS]


def layer_keys(layer: PipeLayer, config) -> dict[str, str]:
    """{our key: HF key} for one layer file, given a transformers config of a supported family."""
    if not layer.has_file:
        return {}
    keys = KEY_TABLE[layer.kind]
    if layer.kind == DECODER:
        optional = _QKV_BIAS | _O_BIAS | _MLP_BIAS | _QK_NORM | _NORMS | _SPLIT_QKV | _FUSED_QKV
        present = _optional_keys(config)
        keys = {ours: tpl.format(layer.block) for ours, tpl in keys.items() if ours not in optional or ours in present}
        # The MLP: a sparse block's keys, or the dense MLP's under the family's own name (Llama 4: feed_forward).
        mlp = sparse_block_keys(config) if is_sparse_layer(config, layer.block) else dense_mlp_keys(config)
        keys = {ours: hf for ours, hf in keys.items() if ours not in (*_DENSE_MLP, *_FUSED_GATE_UP)}
        keys |= {ours: DECODER_PREFIX.format(layer.block) + ours for ours in mlp}
    return dict(keys)


def hf_key_to_layer(hf_key: str, num_layers: int, tie_word_embeddings: bool) -> tuple[int, str] | None:
    """Map an HF key to (pipeline layer index, our key), or None for keys to drop.

    Raises:
        KeyError: the key is not in the key table (another architecture, or a block
            number beyond `num_layers`).
    """
    if any(p.match(hf_key) for p in _DROP_PATTERNS):
        return None
    for kind, ours, pattern in _HF_PATTERNS:
        m = pattern.match(hf_key)
        if not m:
            continue
        if kind == EMBED:
            return 0, ours
        if kind == DECODER:
            block = int(m.group(1))
            if block >= num_layers:
                raise KeyError(f"{hf_key}: block {block} >= num_hidden_layers={num_layers}")
            return decoder_index(block), ours
        if kind == NORM:
            return num_layers + 1, ours
        # LM head: with tied embeddings it is the embedding's weight, stored once in layer 0.
        return None if tie_word_embeddings else (num_layers + 2, ours)
    for pattern in _MOE_PATTERNS:
        m = pattern.match(hf_key)
        if m:
            block = int(m.group(1))
            if block >= num_layers:
                raise KeyError(f"{hf_key}: block {block} >= num_hidden_layers={num_layers}")
            return decoder_index(block), m.group(2)
    raise KeyError(f"{hf_key}: not a key of the supported decoder families (models/key_table.py)")


def linear_modules(config=None) -> list[str]:
    """The linear layers of a decoder block, as named inside it ("self_attn.q_proj", ...): what LoRA can adapt.
    With a dense model's `config`, its family's only (fused projections: `qkv_proj`, `gate_up_proj`); else every
    family's."""
    keys = KEY_TABLE[DECODER] if config is None else layer_keys(PipeLayer(decoder_index(0), DECODER, block=0), config)
    return [k.removesuffix(".weight") for k in keys if k.endswith("_proj.weight")]


def hf_decoder_module(block: int, module: str) -> str:
    """HF name of a module of decoder block `block`: (3, "self_attn.q_proj") -> "model.layers.3.self_attn.q_proj"."""
    return DECODER_PREFIX.format(block) + module


def all_layer_keys(config) -> dict[int, dict[str, str]]:
    """{layer index: {our key: HF key}} for every layer that has a file."""
    layers = pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)
    return {layer.index: layer_keys(layer, config) for layer in layers if layer.has_file}
