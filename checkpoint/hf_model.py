"""Any checkpoint -> a transformers causal LM in memory: the one loader behind generation and reports.

A pipeline checkpoint (what the trainer saves or convert2ckpt.py writes; a LoRA run's adapters are
merged in on load) is read one layer file at a time into a model built on the meta device, so the
weights are held once. A Hugging Face directory is read shard by shard with the reader conversion uses
(`.bin` shards through the safe loader, so a planted pickle is refused by name and never run).
"""

from __future__ import annotations

import os

import torch

from checkpoint.errors import CheckpointError
from checkpoint.hf_reader import is_hf_dir, iter_tensors, read_model_config
from checkpoint.names import LORA_FILE


def load_causal_lm(path: str, tag: str | None = None, dtype: torch.dtype = torch.float32):
    """A transformers `AutoModelForCausalLM` with the weights of `path`, in eval mode.

    Raises:
        CheckpointError: missing, unsafe or mismatched files (one line naming the file).
    """
    from transformers import AutoModelForCausalLM

    from checkpoint.lora_merge import adapters_from_checkpoint
    from checkpoint.pipeline_reader import PipelineCheckpoint

    config = read_model_config(path)  # a supported model type, else a one-line error
    if is_hf_dir(path):  # conversion's streaming reader: .bin shards go through the safe loader
        tensors = ((name, tensor) for name, tensor, _ in iter_tensors(path))
    else:
        weights, adapters = PipelineCheckpoint(path, tag, config), None
        if os.path.exists(os.path.join(path, LORA_FILE)):  # a LoRA run: base weights + its adapters
            weights, adapters = adapters_from_checkpoint(weights)
        tensors = weights.iter_hf_tensors(adapters)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    state = {k: v.to(dtype) for k, v in tensors}  # strict=False below: old checkpoints' extra buffers ignored
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[0]}")
    # Computed buffers (RoPE's inv_freq) are not in the files: rebuild the rotary module off the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.eval()
