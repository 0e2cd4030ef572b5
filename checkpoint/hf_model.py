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
from models.families import family_of
from models.hub_names import memory_key
from models.hub_parts import part_keys
from models.key_table import DECODER_PREFIX, hub_index
from models.layer_kinds import is_sparse_layer
from models.moe import expert_keys
from models.pipe_layout import pipe_layers


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
    from accelerate import init_empty_weights  # (PEFT's dependency)

    with init_empty_weights(include_buffers=False):  # the weights on the meta device, computed buffers made
        model = AutoModelForCausalLM.from_config(config)
    _hub_names_load(model, config)
    name = _in_memory(config)
    state = {name(k): v.to(dtype) for k, v in tensors}  # strict=False below: old checkpoints' extra buffers ignored
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointError(f"{path}: no weights for {missing[0]}")
    return model.eval()


def _in_memory(config):
    """hub key -> the key transformers' model loads it under: a decoder layer's own keys as our layers load them
    (`model.layers.N.` + our key: per-expert keys the hooks below fuse), others as its `from_pretrained` renames."""
    index = hub_index(config)
    blocks = {layer.index: layer.block for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings)}

    def name(key: str) -> str:
        found = index.get(key)
        if found is not None and found[0] in blocks:
            prefix = DECODER_PREFIX.format(blocks[found[0]])
            if key.startswith(prefix):
                return prefix + found[1]
        return memory_key(config, key)

    return name


def _hub_names_load(model, config) -> None:
    """The hub's key names load into transformers' model as its `from_pretrained` reads them: renamed keys by
    `memory_key`, per-expert keys (Mixtral's `block_sparse_moe.experts.0.w1.weight`) fused into its experts by the
    hooks our own layers load them with (models/moe.py `expert_keys`)."""
    for block, layer in enumerate(model.model.layers):
        part_keys(layer, config)  # (Kimi Linear's short convolutions, three tensors on the hub)
        if family_of(config).moe is not None and is_sparse_layer(config, block):
            expert_keys(layer, config)
