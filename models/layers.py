"""Pipeline layers: self-contained modules with a fixed tuple signature, built on transformers' LLaMA.

Data flow through one micro-batch (B = micro-batch size, S = sequence length, H = hidden size):

    (input_ids[B,S] long, position_ids[B,S] long)
      -> EmbeddingPipe    -> (hidden[B,S,H], position_ids)
      -> DecoderLayerPipe -> (hidden[B,S,H], position_ids)      x num_hidden_layers
      -> NormPipe         -> hidden[B,S,H]
      -> LMHeadPipe       -> logits[B,S,V]

Only `hidden` is a floating tensor, so it is the only tensor that crosses a stage boundary with a
gradient. RoPE cos/sin and the causal mask are rebuilt inside every decoder layer from the integer
`position_ids`: a float mask would need a gradient, cost B*S*S of traffic and block SDPA/flash.

The modules subclass the transformers classes so their state_dict keys are the HF suffixes listed
in `models.layout.KEY_TABLE`, and their maths is HF's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

from models.layout import DECODER, EMBED, LM_HEAD, NORM, PipeLayer


class Fp32RotaryEmbedding(LlamaRotaryEmbedding):
    """HF's rotary embedding whose `inv_freq` stays fp32 when the module is cast to bf16/fp16.

    NOTE: DeepSpeed casts the whole module (buffers included) to the training dtype; a bf16
    `inv_freq` shifts RoPE angles by whole radians at long positions.
    """

    def _apply(self, fn, recurse=True):
        inv_freq, original = self.inv_freq.float(), self.original_inv_freq.float()
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        self.original_inv_freq = original.to(self.inv_freq.device)
        return self


class EmbeddingPipe(nn.Embedding):
    """Token embedding. Keys: `weight` = HF `model.embed_tokens.weight`."""

    def __init__(self, config):
        super().__init__(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, position_ids = inputs  # [B, S], [B, S]
        hidden = super().forward(input_ids)  # [B, S, H]
        if torch.is_grad_enabled() and not self.weight.requires_grad:
            # NOTE: a frozen embedding (LoRA) still has to hand the next stage a tensor that takes a gradient.
            hidden.requires_grad_()
        return hidden, position_ids


def causal_additive_mask(seq_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, S, S] additive causal mask for eager attention (0 on and below the diagonal)."""
    mask = torch.full((seq_len, seq_len), torch.finfo(dtype).min, dtype=dtype, device=device)
    return torch.triu(mask, diagonal=1)[None, None]


class DecoderLayerPipe(LlamaDecoderLayer):
    """One HF LLaMA decoder block. Keys: the suffixes of HF `model.layers.{b}.*`.

    Sequences are right-padded and padded positions carry ignored labels, so a plain causal mask
    is exact for every scored token: no padding mask needs to cross stages. SDPA and flash-attn
    get `attention_mask=None` and apply causality themselves (their fast path); eager attention
    gets an additive mask built here.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attn_implementation = config._attn_implementation or "sdpa"
        self.rotary_emb = Fp32RotaryEmbedding(config)  # non-persistent buffers only: no state_dict keys

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, position_ids = inputs  # [B, S, H], [B, S]
        cos_sin = self.rotary_emb(hidden, position_ids)  # 2 x [B, S, head_dim]
        mask = None
        if self.attn_implementation == "eager":
            mask = causal_additive_mask(hidden.shape[1], hidden.dtype, hidden.device)
        hidden = super().forward(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin)
        return hidden, position_ids


class NormPipe(LlamaRMSNorm):
    """Final RMSNorm. Keys: `weight` = HF `model.norm.weight`. Drops `position_ids`."""

    def __init__(self, config):
        super().__init__(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        hidden, _ = inputs
        return super().forward(hidden)


class LMHeadPipe(nn.Linear):
    """Output projection. Keys: `weight` = HF `lm_head.weight`."""

    def __init__(self, config):
        super().__init__(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden)  # [B, S, V]


def tied_lm_head_forward(embedding: EmbeddingPipe, hidden: torch.Tensor) -> torch.Tensor:
    """LM head that reuses the (tied) input embedding's weight: `TiedLayerSpec.forward_fn`."""
    return F.linear(hidden, embedding.weight)  # [B, S, V]


def layer_class_and_args(layer: PipeLayer, config) -> tuple[type[nn.Module], tuple]:
    """The module class of a pipeline layer and its constructor arguments (the one kind -> module table).

    A tied LM head has no module of its own: callers build the embedding's class and apply
    `tied_lm_head_forward` (DeepSpeed's `TiedLayerSpec`).
    """
    if layer.kind == DECODER:
        return DecoderLayerPipe, (config, layer.block)
    cls = {EMBED: EmbeddingPipe, NORM: NormPipe, LM_HEAD: EmbeddingPipe if not layer.has_file else LMHeadPipe}
    return cls[layer.kind], (config,)


def build_layer(layer: PipeLayer, config) -> nn.Module:
    cls, args = layer_class_and_args(layer, config)
    return cls(*args)


@torch.no_grad()
def init_weights(module: nn.Module, initializer_range: float) -> None:
    """HF LLaMA initialisation, for runs that start from scratch instead of a checkpoint."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.weight.normal_(0.0, initializer_range)
            if m.bias is not None:
                m.bias.zero_()
        elif isinstance(m, nn.Embedding):
            m.weight.normal_(0.0, initializer_range)
            if m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()
        elif isinstance(m, LlamaRMSNorm):
            m.weight.fill_(1.0)
