"""`convert2ckpt.py --verify CKPT --against HF_DIR`: the checkpoint's logits against the HF model's.

A fixed probe batch runs through the checkpoint one pipeline layer at a time (one layer file in
memory) and through the Hugging Face model loaded whole, in fp32 with eager attention.
"""

from __future__ import annotations

import json
import os

import torch

from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import read_model_config
from checkpoint.pipeline_reader import PipelineCheckpoint
from models.layers import build_layer, split_stats, tied_lm_head_forward
from models.pipe_layout import EMBED, pipe_layers


@torch.inference_mode()
def probe_logits_streamed(ckpt: PipelineCheckpoint, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of the checkpoint on `input_ids`, building and loading one pipeline layer at a time."""
    config = ckpt.config
    config._attn_implementation = "eager"
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    x, embedding = (input_ids, position_ids), None
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if not layer.has_file:  # tied LM head: the embedding's weight
            x = tied_lm_head_forward(embedding, x)
            continue
        module = build_layer(layer, config)
        module.load_state_dict(ckpt.load_whole(layer), strict=True)
        module.float().eval()
        x = module(x)
        if layer.kind == EMBED:
            embedding = module
    return split_stats(x)[0]


def _hf_reference(hf_dir: str, hf_config):
    """transformers' model of `hf_dir` in fp32 (eager attention): its causal LM; for a model type transformers maps to
    none, the class config.json names (Kimi K2.5's container), and for another name of a family's architecture
    (Kimi K2's `kimi_k2`) with the family's config, whose model_type picks transformers' weight renames."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from models.families import ALIASES

    with open(os.path.join(hf_dir, "config.json")) as f:
        conf = json.load(f)
    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    if conf.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **kwargs)
    if conf.get("model_type") in ALIASES:
        kwargs["config"] = hf_config
    return getattr(transformers, conf["architectures"][0]).from_pretrained(hf_dir, **kwargs)


def compare_with_hf(ckpt_dir: str, tag: str, hf_dir: str, seq_len: int = 16) -> float:
    """Max |logit difference| between the checkpoint and the HF model on a fixed probe batch (fp32)."""
    ckpt = PipelineCheckpoint(ckpt_dir, tag)
    config = ckpt.config
    hf_config = read_model_config(hf_dir)
    if (hf_config.num_hidden_layers, hf_config.hidden_size) != (config.num_hidden_layers, config.hidden_size):
        raise CheckpointError(f"{hf_dir}: a different model size than {ckpt_dir}")
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, seq_len), generator=generator)
    ours = probe_logits_streamed(ckpt, ids)
    model = _hf_reference(hf_dir, hf_config)
    with torch.inference_mode():
        ref = model(ids).logits
    return float((ours.float() - ref).abs().max())
