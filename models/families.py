"""The dense decoder families this project trains, and where transformers keeps each one's classes.

A family is a `model_type` of `config.json`. Each reuses transformers' own decoder layer, RMSNorm and
rotary embedding for that family (models/layers.py builds the pipeline classes on them), so the maths is
HF's own. What differs between families, as data:

    family    q/k/v/o biases                    MLP biases     q/k norms    sliding window
    llama     config.attention_bias (all four)  config.mlp_bias  -          -
    mistral   -                                 -              -            config.sliding_window (every layer)
    qwen2     q, k, v always                    -              -            layer_types == "sliding_attention"
    qwen3     config.attention_bias (all four)  -              per head     layer_types == "sliding_attention"

Mixture-of-experts families (`Family.moe`, models/moe.py) share that attention and put a sparse MLP block in
some or all layers; what differs is where their keys live and which layers are sparse:

    family      attention as   expert keys on the hub              sparse layers             shared expert
    mixtral     mistral        block_sparse_moe.experts.N.w1/w3/w2  every one                 -
    qwen2_moe   qwen2          mlp.experts.N.gate/up/down_proj     decoder_sparse_step,      mlp.shared_expert (+ gate)
                                                                   mlp_only_layers
    qwen3_moe   qwen3          mlp.experts.N.gate/up/down_proj     as qwen2_moe              -
    llama4_text own            feed_forward.experts.gate_up_proj,  moe_layers                feed_forward.shared_expert
                               .down_proj (fused, x @ W layout)

Llama 4 (`llama4_text`: Llama4ForCausalLM, and the text model of Llama4ForConditionalGeneration checkpoints) brings
its own attention: RoPE (interleaved pairs, complex `freqs_cis`) on most layers with chunked attention
(`attention_chunk_size`) and weightless L2 q/k norms after RoPE, NoPE layers with full causal attention and
attention temperature tuning; its dense layers' MLP width is `intermediate_size_mlp`, its routers a sigmoid of the
top-k logits that scales each expert's input.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    """How a mixture-of-experts family names and places its sparse blocks.

    hub_block: the sparse block's name in hub checkpoints (transformers keeps it as `mlp` in memory).
    expert_names: each expert's gate, up and down projection on the hub (`{hub_block}.experts.N.<name>.weight`).
    num_experts / expert_size: the config fields with the number of experts and each expert's MLP width.
    every_layer: every decoder layer is sparse (else `decoder_sparse_step` and `mlp_only_layers` decide).
    shared_expert: a dense expert every token goes through (`{block}.shared_expert`), sigmoid-gated
        (`{block}.shared_expert_gate`) when `shared_gate`.
    always_renormalise: top-k weights always divided by their sum (else only with `config.norm_topk_prob`).
    block / router: the in-memory names of the sparse block in a decoder layer and of its router in the block.
    router_logits: where the router's outputs hold the logits (transformers' tuples differ by family).
    fused_hub: the hub keeps each layer's experts fused as transformers does, in x @ W layout
        (`experts.gate_up_proj` [E, H, 2I], `experts.down_proj` [E, I, H]); else one key per expert.
    moe_layers: the config lists the sparse layers (`config.moe_layers`).
    aux_loss: transformers adds a load-balancing loss for the family (Llama 4's adds none).
    """

    hub_block: str
    expert_names: tuple[str, str, str]
    num_experts: str
    expert_size: str
    every_layer: bool
    shared_expert: bool = False
    shared_gate: bool = True
    always_renormalise: bool = False
    block: str = "mlp"
    router: str = "gate"
    router_logits: int = 0
    fused_hub: bool = False
    moe_layers: bool = False
    aux_loss: bool = True


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers class prefix: Llama, Mistral, Qwen2, Qwen3
    attention_bias: str  # "config" (config.attention_bias), "qkv" (q/k/v always), "qkv_bias" (config.qkv_bias), "none"
    mlp_bias: bool  # config.mlp_bias applies
    qk_norm: bool  # RMSNorm over head_dim on q and k (self_attn.q_norm / k_norm)
    window_everywhere: bool = False  # config.sliding_window applies to every layer (else per attention module)
    moe: MoeSpec | None = None  # a mixture-of-experts family
    package: str = ""  # transformers' models/<package> (default: the model type)
    dense_size: str = "intermediate_size"  # the config field with a dense layer's MLP width
    flash_attention: bool = True  # transformers runs the family with flash-attn (Llama 4's chunked attention: no)

    def module(self):
        package = self.package or self.model_type
        return importlib.import_module(f"transformers.models.{package}.modeling_{package}")

    def hf_class(self, suffix: str):
        """transformers' `<Prefix><suffix>` of this family, e.g. DecoderLayer, RMSNorm, RotaryEmbedding."""
        return getattr(self.module(), self.prefix + suffix)

    @property
    def config_class(self) -> str:
        return self.prefix + "Config"


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "Llama", attention_bias="config", mlp_bias=True, qk_norm=False),
        Family("mistral", "Mistral", attention_bias="none", mlp_bias=False, qk_norm=False, window_everywhere=True),
        Family("qwen2", "Qwen2", attention_bias="qkv", mlp_bias=False, qk_norm=False),
        Family("qwen3", "Qwen3", attention_bias="config", mlp_bias=False, qk_norm=True),
        Family(
            "mixtral",
            "Mixtral",
            attention_bias="none",
            mlp_bias=False,
            qk_norm=False,
            window_everywhere=True,
            moe=MoeSpec(
                "block_sparse_moe",
                ("w1", "w3", "w2"),
                "num_local_experts",
                "intermediate_size",
                every_layer=True,
                always_renormalise=True,
            ),
        ),
        Family(
            "qwen2_moe",
            "Qwen2Moe",
            attention_bias="qkv_bias",
            mlp_bias=False,
            qk_norm=False,
            moe=MoeSpec(
                "mlp",
                ("gate_proj", "up_proj", "down_proj"),
                "num_experts",
                "moe_intermediate_size",
                every_layer=False,
                shared_expert=True,
            ),
        ),
        Family(
            "qwen3_moe",
            "Qwen3Moe",
            attention_bias="config",
            mlp_bias=False,
            qk_norm=True,
            window_everywhere=True,
            moe=MoeSpec(
                "mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size", every_layer=False
            ),
        ),
        Family(
            "llama4_text",
            "Llama4Text",
            attention_bias="config",
            mlp_bias=False,
            qk_norm=False,  # Llama 4's q/k norms are weightless (no keys)
            moe=MoeSpec(
                "feed_forward",
                ("gate_proj", "up_proj", "down_proj"),
                "num_local_experts",
                "intermediate_size",
                every_layer=False,
                shared_expert=True,
                shared_gate=False,
                block="feed_forward",
                router="router",
                router_logits=1,
                fused_hub=True,
                moe_layers=True,
                aux_loss=False,
            ),
            package="llama4",
            dense_size="intermediate_size_mlp",
            flash_attention=False,
        ),
    )
}


@dataclass(frozen=True)
class Container:
    """A multimodal checkpoint whose text model is one of FAMILIES: its config.json nests the text model's config
    under `config_key`, and its weights carry `prefix` before the text model's keys (the other towers' keys are
    not read). Conversion takes the text model only; the pipeline checkpoint is that text model's."""

    config_key: str
    prefix: str
    text_architecture: str


CONTAINERS: dict[str, Container] = {
    "llama4": Container("text_config", "language_model.", "Llama4ForCausalLM"),  # Llama4ForConditionalGeneration
}


def hf_classes(suffix: str) -> tuple[type, ...]:
    """transformers' `<Prefix><suffix>` class of every family (for isinstance checks)."""
    return tuple(family.hf_class(suffix) for family in FAMILIES.values())


def family_of(config) -> Family:
    """The family of a transformers config (KeyError for a model type not in FAMILIES)."""
    return FAMILIES[getattr(config, "model_type", None) or "llama"]


def sliding_window(config, attention) -> int | None:
    """The window of one layer's attention module (None: full causal attention), as HF applies it."""
    if family_of(config).window_everywhere:
        return getattr(config, "sliding_window", None)
    return getattr(attention, "sliding_window", None)


def attention_chunk(config, block: int) -> int | None:
    """The chunk of decoder block `block`'s attention (Llama 4's "chunked_attention" layers: a query attends the
    keys of its own `attention_chunk_size` positions only), or None."""
    types = getattr(config, "layer_types", None)
    if types and types[block] == "chunked_attention":
        return config.attention_chunk_size
    return None


def is_sparse_layer(config, block: int) -> bool:
    """Whether decoder block `block` has a mixture-of-experts MLP (as the family's decoder layer decides)."""
    moe = family_of(config).moe
    if moe is None:
        return False
    if moe.every_layer:
        return True
    if moe.moe_layers:
        return block in config.moe_layers
    return (
        block not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (block + 1) % config.decoder_sparse_step == 0
    )
