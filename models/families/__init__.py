"""The family registry: one module per decoder family in this package, read by generic code that names none.

A family is a `model_type` of `config.json`. Each reuses transformers' own decoder layer, RMSNorm and rotary
embedding for it (models/layers.py builds the pipeline classes on them), so the maths is transformers' own. A
family module calls `register(Family(...))` with what is particular to it, as data:

- `prefix` (and `package`): where transformers keeps its classes (`transformers.models.<package>.modeling_<package>`,
  `<Prefix>DecoderLayer`, `<Prefix>RMSNorm`, `<Prefix>RotaryEmbedding`, `<Prefix>Config`);
- its decoder layer's norms (`norms`) and which of them feed a tensor-parallel region (`tp_entry_norms`), whether its
  embeddings are scaled (`scaled_embedding`); the head's `final_logit_softcapping` and a rotary embedding that takes
  the layer's type (`config.layer_types`) are read from transformers' config and classes, not declared;
- the config fields of its biases (`qkv_bias`, `o_bias`, `mlp_bias`), per-head q/k norms (`qk_norm`), where its
  window applies (`window_everywhere`), its dense MLP's width field (`dense_size`); a layer's keys are not declared:
  models/key_table.py takes them from transformers' own layer built on the meta device;
- a mixture-of-experts family's `MoeSpec` (hub key layout, router, shared expert, which layers are sparse; `moe_when`);
- read from transformers, not declared: SDPA support (`resolve_attention`), tensors kept fp32 (`keeps_fp32`), hub
  keys its model skips at load (`ignored_on_load`); what kind each layer is (its window, recurrence, sparse MLP) is
  models/layer_kinds.py's, from the config and these fields;
- the tensors its layers share across layers (`carries`: models/carry.py), its tiny test model's fields (`tiny`),
  a multimodal checkpoint whose text model it is (`register_container`).
Adding a family built like one here is one module in this package (and a row in docs/families.md);
tests/test_structure.py fails when a family's name appears in code outside it. Model code only: no DeepSpeed.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from dataclasses import dataclass, field, replace

import torch

from models.families.container import Container

# The family of a config that names none (old LLaMA checkpoints have no model_type).
DEFAULT_MODEL_TYPE = "llama"


@dataclass(frozen=True)
class MoeSpec:
    """How a mixture-of-experts family names and places its sparse blocks.

    hub_block: the sparse block's name in hub checkpoints (transformers keeps it as `block` in memory).
    expert_names: each expert's gate, up and down projection on the hub (`{hub_block}.experts.N.<name>.weight`).
    num_experts / expert_size: the config fields with the number of experts and each expert's MLP width.
    every_layer: every decoder layer is sparse (else `first_dense`, `moe_layers`, `layer_types`, `interval`, or
        `decoder_sparse_step` and `mlp_only_layers`).
    first_dense: the config field with the number of dense layers before the sparse ones (DeepSeek's
        `first_k_dense_replace`), "" where there are none.
    shared_expert: a dense expert every token goes through (`{block}.shared_expert`, DeepSeek's `shared_experts`),
        sigmoid-gated (`{block}.shared_expert_gate`) when `shared_gate`.
    router_choice: the router returns its own choice of experts (DeepSeek's and Mistral 4's: [logits, weights,
        indices], group-limited top-k on its scores, plus `e_score_correction_bias` where `score_bias`): the router
        statistics count the experts it chose, not a softmax top-k of its logits.
    score_bias: the router keeps a score bias that steers its choice only (DeepSeek's `e_score_correction_bias`):
        `moe.bias_update_rate` can balance the experts' loads by moving it.
    always_renormalise: top-k weights always divided by their sum (else only with `config.norm_topk_prob`).
    block / router: the in-memory names of the sparse block in a decoder layer and of its router in the block.
    router_logits: where the router's outputs hold the logits (transformers' tuples differ by family).
    hub_fused: the hub keeps each layer's experts fused as transformers keeps them in memory (`experts.gate_up_proj`
        and `experts.down_proj`: x @ W layout [E, H, 2I] and [E, I, H] for Llama 4 and gpt-oss, [E, 2I, H] and
        [E, H, I] for Mistral 4 and Qwen3.5-MoE), and the router as `{block}.{router}`; else one key per expert.
        (transformers' saves of the [E, 2I, H] ones may hold a key per expert: checkpoint/expert_layouts.py.)
    scaled_inputs: the router's scores scale each expert's input, and transformers' block runs every expert on
        every token (0-scaled outside its top-k); expert parallelism and `moe.routed_experts` send each expert its
        routed tokens only (models/expert_parallel.py). Else transformers' router and fused experts weight outputs.
    moe_layers: the config lists the sparse layers (`config.moe_layers`).
    layer_types: the config field listing each layer's MLP kind, sparse where not "dense" (`mlp_layer_types`); or
        each block's kind, sparse where "moe" (Nemotron-H's `layers_block_type`).
    interval: sparse every `moe_layer_interval`-th layer from `moe_layer_start_index` to `moe_layer_end_index`.
    aux_loss: transformers adds a load-balancing loss for the family.
    """

    hub_block: str
    expert_names: tuple[str, str, str]
    num_experts: str
    expert_size: str
    every_layer: bool
    first_dense: str = ""
    router_choice: bool = False
    score_bias: bool = False
    shared_expert: bool = False
    shared_gate: bool = True
    always_renormalise: bool = False
    block: str = "mlp"
    router: str = "gate"
    router_logits: int = 0
    hub_fused: bool = False
    # gate and up columns interleaved in the fused x @ W experts (gpt-oss's `gate_up_proj` [E, H, 2I]: gate j at
    # column 2j, up j at 2j + 1): a tensor-parallel rank takes a contiguous block of columns, each pair whole.
    interleaved_gate_up: bool = False
    scaled_inputs: bool = False
    moe_layers: bool = False
    layer_types: str = ""
    interval: bool = False
    aux_loss: bool = True
    top_k: str = "num_experts_per_tok"  # the config field of the experts a token is routed to
    router_probabilities: bool = False  # the router returns probabilities, not logits (Gemma 4's): their log stands in
    beside_mlp: bool = False  # experts beside the layer's dense MLP, the layer itself their block (`block` "": Gemma 4)
    block_bias: str = ""  # a score bias of the block's, not the router's (MiniMax-M2's, LFM2-MoE's `expert_bias`)


@dataclass(frozen=True)
class Family:
    """One decoder family (see the module docstring)."""

    model_type: str
    prefix: str  # transformers class prefix: Llama, Mistral, Qwen2, Qwen3, ...
    # Biases of q/k/v, of o and of the MLP's projections: True (always), False (never), or the config field that says.
    qkv_bias: bool | str = False
    o_bias: bool | str = False
    mlp_bias: bool | str = False
    qk_norm: bool | str = False  # RMSNorm over head_dim on q and k (self_attn.q_norm / k_norm); or its config field
    # The q/k norms normalise the whole projection (all heads at once; OLMo's): under TP their weights split with the
    # heads and their statistics are summed over the ranks.
    qk_norm_whole: bool = False
    window_everywhere: bool = False  # config.sliding_window applies to every layer (else per attention module)
    moe: MoeSpec | None = None  # a mixture-of-experts family
    moe_when: str = ""  # the config field that switches the experts on (Gemma 4's `enable_moe_block`), "": always
    package: str = ""  # transformers' models/<package> (default: the model type)
    dense_size: str = "intermediate_size"  # the config field with a dense layer's MLP width
    mlp: str = "mlp"  # a dense layer's MLP module (LFM2's `feed_forward`; with experts, their block's name)
    # Why flash-attn cannot run the family's attention as transformers does ("" where it can; SDPA: `resolve_attention`)
    flash_refused: str = ""
    config_name: str = ""  # transformers' config class (default `<Prefix>Config`)
    # Class names after the prefix where not `<Prefix>RotaryEmbedding` ... (Qwen3.5's text: `TextRotaryEmbedding`).
    class_names: dict = field(default_factory=dict, compare=False)
    # The decoder layer's RMSNorms, and those whose output enters a tensor-parallel split region (the input of
    # q/k/v or of gate/up): the others normalise whole (or, under sequence parallelism, sharded) activations. No
    # entry norms (OLMo's layer normalises after each sublayer only): the split regions start at the attention's
    # and the MLP's own inputs.
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    tp_entry_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    scaled_embedding: bool = False  # embeddings times sqrt(hidden_size) in the weights' dtype (Gemma's)
    # muP's multipliers outside the decoder layer (Granite's), as config fields: embeddings times the first, logits
    # divided by the second, each as a Python float as transformers applies it. "": none.
    embedding_multiplier: str = ""
    logits_divisor: str = ""
    logits_multiplier: str = ""  # logits times this config field (Cohere's `logit_scale`)
    fused_qkv: bool = False  # one `self_attn.qkv_proj` holds q, k and v (Phi-3's)
    fused_gate_up: bool = False  # one `mlp.gate_up_proj` holds gate and up (Phi-3's, GLM-4's)
    tp_refused: str = ""  # why tensor parallelism is refused for the family until its split is built ("": it splits)
    # transformers' tensor-parallel plan keeps the attention whole on every rank (DeepSeek-V4's, one K=V head): only
    # the MLP (its experts, its shared expert) splits; the attention's one entry norm is no TP entry (`tp_entry_norms`
    # names the MLP's); under sequence parallelism it gathers the row and keeps its own positions of the output.
    replicated_attention: bool = False
    parallel_block: bool = False  # attention and the MLP read one norm's output (Cohere's): one TP entry per layer
    per_head: tuple[str, ...] = ()  # attention parameters with one entry per head (gpt-oss's sinks): split with them
    # The attention reads an explicit causal mask even on unpacked rows (DeepSeek-V3.2's indexer scores against it).
    always_mask: bool = False
    frozen: tuple[str, ...] = ()  # decoder modules transformers runs without gradients (DeepSeek-V3.2's indexer)
    # Tensors its layers share across layers, by mechanism (models/carry.py: "per_layer_inputs", "shared_kv",
    # "shared_index", "routing_tokens"): carried across stage boundaries by name, from their maker to their last reader.
    carries: tuple[str, ...] = ()
    cp_refused: str = ""  # why context parallelism is refused for the family, after "<model_type>'s" ("": it splits)
    final_norm: str = "norm"  # the final RMSNorm's name in the model (`model.norm`; LFM2's `model.embedding_norm`)
    attention: str = "self_attn"  # the attention module's name in an attention block (Nemotron-H's `mixer`)
    embedding: str = "embed_tokens"  # the token embedding's name in the model (`model.embed_tokens`; Nemotron-H's)
    # Buffers transformers' model attaches to each layer's module (path) from a function of the config (Falcon-H1's
    # `mamba.mup_vector`, `compute_mup_vector`): {path: the modeling module's function}.
    layer_buffers: dict[str, str] = field(default_factory=dict, compare=False)
    packing_refused: str = ""  # why packed rows are refused for the family, after "<model_type>'s" ("": they run)
    # The config field of the number of residual streams (DeepSeek-V4's hyper-connections, `hc_mult`): the hidden
    # states are [B, S, N, H] from the embedding (each token's vector repeated N times) to the family's
    # `HyperHead`, which the final norm's layer holds and runs before the norm. "": one stream, [B, S, H].
    streams: str = ""
    # transformers renames the family's hub keys at load and back at save (its conversion mapping: DeepSeek-V4's
    # `attn.wq_a`): the key table holds the names as transformers saves them (models/hub_names.py `hub_key`).
    hub_renames: bool = False
    # A config.json value the family's attention would silently ignore: refused at load with the reason.
    refused_fields: dict[str, str] = field(default_factory=dict, compare=False)
    tiny: dict = field(default_factory=dict, compare=False)  # config overrides of the tiny test model
    # What the family's config class assumes for a key config.json leaves out, where that differs from
    # `models.config.ConfigFields`' default (tests/test_families.py holds both to transformers).
    config_defaults: dict = field(default_factory=dict, compare=False)

    def has(self, bias: bool | str, config) -> bool:
        """Whether a bias of this family (`qkv_bias`, `o_bias`, `mlp_bias`) is in a model of `config`."""
        return bool(getattr(config, bias, False)) if isinstance(bias, str) else bias

    def module(self):
        package = self.package or self.model_type
        return importlib.import_module(f"transformers.models.{package}.modeling_{package}")

    def hf_class(self, suffix: str):
        """transformers' `<Prefix><suffix>` of this family, e.g. DecoderLayer, RMSNorm, RotaryEmbedding."""
        return getattr(self.module(), self.prefix + self.class_names.get(suffix, suffix))

    @property
    def config_class(self) -> str:
        return self.config_name or self.prefix + "Config"

    def keeps_fp32(self, key: str, dtype=None) -> bool:
        """Whether `key` (a hub key, or a parameter's or buffer's name in a layer) stays fp32 in a model of `dtype`,
        as transformers keeps it: `_keep_in_fp32_modules_strict` of the family's PreTrainedModel in fp16 and bf16
        (DeepSeek's `e_score_correction_bias`; in fp32 keeping is moot), its `_keep_in_fp32_modules` in fp16 only
        (DeepSeek-V3.2's `indexer.weights_proj`, gpt-oss's norms). Each name, its `*` any characters, is searched
        for in the key, as transformers does."""
        names = _fp32_names(self.module(), strict=True)
        if dtype == torch.float16:
            names |= _fp32_names(self.module(), strict=False)
        return any(re.search(name.replace("*", ".*"), key) for name in names)

    def fp32_in_fp16(self) -> frozenset[str]:
        """What transformers keeps fp32 under fp16 only (`_keep_in_fp32_modules`: gpt-oss's norms)."""
        return _fp32_names(self.module(), strict=False)

    def ignored_on_load(self) -> tuple[str, ...]:
        """The patterns of hub keys transformers' model of the family skips at load (its multi-token-prediction
        weights: `_keys_to_ignore_on_load_unexpected`)."""
        return tuple(_pretrained_attr(self.module(), "_keys_to_ignore_on_load_unexpected", None) or ())

    def initial_norm_weight(self) -> float:
        """What the family's RMSNorm initialises its weight to (1; Gemma's (1 + w) norms: 0)."""
        return float(self.hf_class("RMSNorm")(1).weight.detach()[0])


def _pretrained_classes(module) -> list[type]:
    """The modeling module's own PreTrainedModel classes (not transformers' base class it imports)."""
    classes = [getattr(module, n) for n in dir(module) if n.endswith("PreTrainedModel")]
    return [cls for cls in classes if isinstance(cls, type) and cls.__module__ == module.__name__]


def _pretrained_attr(module, name: str, default):
    """An attribute of the modeling module's PreTrainedModel classes (the first that sets it)."""
    for cls in _pretrained_classes(module):
        if name in vars(cls):
            return vars(cls)[name]
    return default


def resolve_attention(config, requested: str | None) -> str:
    """The attention implementation a model of `config` runs: `requested`, or None for the family's default (SDPA, or
    eager where transformers runs the family without SDPA, as its models fall back). ValueError, one line, for a
    request the family's attention cannot honour (gpt-oss's sinks in SDPA, Llama 4's chunks in flash-attn)."""
    family = family_of(config)
    sdpa = _pretrained_attr(family.module(), "_supports_sdpa", True)
    if requested is None:
        return "sdpa" if sdpa else "eager"
    if requested == "sdpa" and not sdpa:
        raise ValueError(
            f"model.attn_implementation=sdpa: transformers runs {family.model_type} without SDPA (its attention "
            "adds what SDPA cannot); use eager, or leave it unset"
        )
    if requested == "flash_attention_2" and family.flash_refused:
        default = "sdpa" if sdpa else "eager"
        raise ValueError(
            f"model.attn_implementation=flash_attention_2: transformers' {family.model_type} does not support it "
            f"({family.flash_refused}); use {default}"
        )
    return requested


@functools.cache
def _fp32_names(module, strict: bool) -> frozenset[str]:
    """`_keep_in_fp32_modules_strict` (`strict`) or `_keep_in_fp32_modules` of every PreTrainedModel class of a
    transformers modeling module."""
    attr = "_keep_in_fp32_modules_strict" if strict else "_keep_in_fp32_modules"
    return frozenset(n for cls in _pretrained_classes(module) for n in getattr(cls, attr, None) or ())


FAMILIES: dict[str, Family] = {}
CONTAINERS: dict[str, Container] = {}
ALIASES: dict[str, str] = {}  # a model_type some checkpoints write for a registered family's architecture


def register(family: Family) -> Family:
    """Add a family (called once by its module in this package)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"model_type={family.model_type!r} registered twice")
    entries = (0, 2, 3) if family.moe is not None and family.moe.beside_mlp else (0, 2)  # and the experts' own
    entries = (1,) if family.replicated_attention or family.parallel_block else entries  # the MLP's only, or one
    if not family.tp_refused and len(family.tp_entry_norms) not in entries:  # TP enters twice per layer (or 3 times)
        raise ValueError(f"{family.model_type}: tp_entry_norms must name the norms before attention and the MLP")
    FAMILIES[family.model_type] = family
    return family


def register_container(model_type: str, container: Container) -> None:
    """Add a multimodal checkpoint type whose text model is a registered family."""
    CONTAINERS[model_type] = container


def register_alias(model_type: str, family_type: str) -> None:
    """Read config.json files of `model_type` as `family_type`'s (Kimi K2's `kimi_k2`: DeepSeek-V3's architecture)."""
    ALIASES[model_type] = family_type


def _load_family_modules() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        importlib.import_module(f"{__name__}.{info.name}")


def tp_refusal(config, tp_size: int) -> str | None:
    """Why a model of `config` cannot be split over `tp_size` > 1 tensor-parallel ranks (`Family.tp_refused`)."""
    family = family_of(config)
    if tp_size <= 1 or not family.tp_refused:
        return None
    why = f"model_type={family.model_type!r} is not split over tensor-parallel ranks ({family.tp_refused})"
    return why + "; use pipeline, context and data parallelism"


def hf_classes(suffix: str) -> tuple[type, ...]:
    """transformers' `<Prefix><suffix>` class of every family (for isinstance checks)."""
    return tuple(family.hf_class(suffix) for family in FAMILIES.values())


def family_of(config) -> Family:
    """The family of a transformers config (KeyError for a model type not in FAMILIES): without its experts where
    the config leaves them off (`Family.moe_when`)."""
    family = FAMILIES[getattr(config, "model_type", None) or DEFAULT_MODEL_TYPE]
    if family.moe_when and not getattr(config, family.moe_when, False):
        return _dense(family)
    return family


_dense = functools.cache(lambda family: replace(family, moe=None))  # a family without its experts


def _register_causal_lm_classes() -> None:
    """Map each family transformers' AutoModelForCausalLM does not (Mistral 4's in 5.23, whose modeling module has
    `Mistral4ForCausalLM` but no Auto entry) to its `<Prefix>ForCausalLM`, through transformers' own registration
    API: a checkpoint of any family here loads with AutoModelForCausalLM (references, `--verify`, exports)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for family in FAMILIES.values():
        if family.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            config_class = type(AutoConfig.for_model(family.model_type))
            AutoModelForCausalLM.register(config_class, family.hf_class("ForCausalLM"), exist_ok=True)


_load_family_modules()
_register_causal_lm_classes()
