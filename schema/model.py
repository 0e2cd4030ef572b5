"""The model's part of the run configuration: the `model` group (conf/model/*.yaml: an architecture preset, all None
when the model comes from `model_name_or_path`, and how the pipeline is built) and the `lora` group. Reading a
checkpoint's config.json against them is models/config.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schema.choice import Choice


class LossType(Choice):
    """`dpo.loss_type`: the preference loss (models/preference.py)."""

    sigmoid = "sigmoid"  # DPO
    ipo = "ipo"
    simpo = "simpo"  # reference-free, length-normalised


class AttnImplementation(Choice):
    sdpa = "sdpa"
    flash_attention_2 = "flash_attention_2"
    eager = "eager"


@dataclass
class ModelSettings:
    """Architecture preset and how the pipeline is built.

    The architecture fields (hidden_size ...) are None when the model comes from
    `model_name_or_path`; a preset that sets them is checked against the checkpoint's config.json
    and used to build a model from scratch when no checkpoint is given.
    """

    name: str = "from_checkpoint"  # the preset's name (conf/model/NAME.yaml)
    source: str | None = None  # where the preset's numbers come from
    model_type: str | None = None  # the family (models/families/, docs/families.md); None: llama
    vocab_size: int | None = None  # embedding rows (config.json's vocab_size)
    hidden_size: int | None = None  # width of the residual stream
    intermediate_size: int | None = None  # width of the MLP
    num_hidden_layers: int | None = None  # decoder blocks
    num_attention_heads: int | None = None  # query heads
    num_key_value_heads: int | None = None  # key/value heads (GQA when fewer than the query heads)
    head_dim: int | None = None  # None: hidden_size / num_attention_heads
    max_position_embeddings: int | None = None  # the longest seq_length without RoPE scaling
    rms_norm_eps: float | None = None  # RMSNorm's epsilon
    rope_theta: float | None = None  # RoPE's base
    tie_word_embeddings: bool | None = None  # the LM head shares the embedding's weights
    num_experts: int | None = None  # experts per sparse block (Mixtral's num_local_experts)
    num_experts_per_tok: int | None = None  # experts each token is routed to (top-k)
    moe_intermediate_size: int | None = None  # each expert's MLP width (Qwen-MoE; Mixtral's is intermediate_size)
    norm_topk_prob: bool | None = None  # Qwen-MoE: the top-k routing weights renormalised to sum to 1
    decoder_sparse_step: int | None = None  # Qwen-MoE: every k-th decoder layer is sparse
    intermediate_size_mlp: int | None = None  # Llama 4: the dense layers' MLP width (intermediate_size: the experts')
    interleave_moe_layer_step: int | None = None  # Llama 4: every k-th decoder layer is sparse
    attention_chunk_size: int | None = None  # Llama 4: RoPE layers attend within chunks of this many positions
    # Any other field of the family's transformers config, by its own name: MLA's ranks (q_lora_rank ...), routers
    # (n_group, routed_scaling_factor ...), linear attention's heads, `rope_parameters` (per layer type where the
    # family has several: Gemma 3). Checked like the fields above; a name the family's config lacks is refused.
    config_fields: dict[str, Any] = field(default_factory=dict)
    # sdpa, eager or flash_attention_2; unset: the family's default, SDPA, or eager where transformers runs the family
    # without SDPA (gpt-oss: its attention sinks). A request the family's attention cannot honour is refused.
    attn_implementation: AttnImplementation | None = None
    # How decoder blocks are split over stages: "parameters" (balanced by parameter count), "compute" (by the
    # parameters a token uses: a sparse block's top-k experts), "uniform", or blocks
    # per stage, e.g. [2, 3, 3, 2]. NOTE: Any because omegaconf has no unions.
    partition: Any = "parameters"
    # Recompute activations in backward: true (every decoder block), false, or k (every k-th block; 0 off).
    # NOTE: Any because omegaconf has no unions.
    activation_checkpointing: Any = False
    loss_chunk_size: int = 0  # cross-entropy over this many tokens at a time (no whole fp32 logits); 0: at once
    # The LM head and the loss as one operation over token tiles (loss_chunk_size tokens, 0: about 256 MiB of fp32
    # logits a tile): no [B, S, V] logits or gradient ever exist. false: the logits made whole, then the loss.
    fused_head_loss: bool = True
    # Split each dense MLP's positions into this many tiles, each run alone and recomputed in backward (DeepSpeed's
    # TiledMLP): no [S, intermediate] tensor at once, for long rows. 0 or 1: off.
    mlp_tiles: int = 0
    vocab_pad_multiple: int = 1  # pad embedding and LM head rows to a multiple of this (and of TP); never exported


@dataclass
class LoraSettings:
    """LoRA adapters on the decoder layers (peft); base weights frozen, only adapters saved."""

    enabled: bool = False  # train adapters only; the base weights stay frozen (export with --merge-lora)
    r: int = 8  # adapter rank
    alpha: float = 16.0  # scaling: the adapter's output is multiplied by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input
    # Linear layers of the decoder to adapt (names as in transformers' modules).
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # QLoRA: "nf4" holds the frozen base's decoder linear weights as bitsandbytes NF4 (models/nf4.py); "none": not
    quantize: str = "none"
    quantize_double: bool = False  # NF4's absmax 8-bit quantized too (bnb_4bit_use_double_quant)
    # with nf4, the routed experts too (transformers' bitsandbytes model keeps them in the run's precision: false)
    quantize_experts: bool = True
    # the hub's FP8 / MXFP4 / INT4 weights of a quantized model_name_or_path held as they are on each stage
    # (dequantized at each matmul, to the weights conversion writes) instead of in bf16 (checkpoint/kept_quantized.py)
    keep_quantized: bool = False


def checkpoint_every(model: ModelSettings) -> int:
    """`model.activation_checkpointing` as k: recompute every k-th decoder block (0: none). Raises ValueError."""
    value = model.activation_checkpointing
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value >= 0:
        return value
    raise ValueError(f"model.activation_checkpointing={value!r} must be true, false or k >= 0 (every k-th block)")
