"""Read a pipeline checkpoint back into Hugging Face key names, one layer at a time.

A layer written by several tensor-parallel ranks (`layer_XX-model_YY`) is merged into whole tensors on
the way (checkpoint/layer_files.py): export, generation and `--verify --against` see one model whatever
the TP degree of the run that saved it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from checkpoint.errors import CheckpointError
from checkpoint.layer_files import checkpoint_tp_size, layer_shard_files, layer_tensor_specs, load_layer_whole
from checkpoint.names import engine_files
from checkpoint.safe_load import check_pickles
from checkpoint.saves import read_tag
from models.layout import EMBED, KEY_TABLE, LM_HEAD, all_layer_keys, layer_file_name, pipe_layers, tp_split
from models.sharding import merged_shape


def _layers(ckpt_dir: str, config, tag: str | None):
    """(step dir, its TP degree, pipeline layer, {our key: HF key}) per layer that has files, in layer order."""
    step_dir = os.path.join(ckpt_dir, read_tag(ckpt_dir, tag))
    if not os.path.isdir(step_dir):
        raise CheckpointError(f"{step_dir}: no such checkpoint")
    check_pickles(step_dir, engine_files(os.listdir(step_dir)))  # unneeded here, but unsafe means tampered
    saved_tp = checkpoint_tp_size(step_dir)
    keys = all_layer_keys(config)
    for layer in pipe_layers(config.num_hidden_layers, config.tie_word_embeddings):
        if layer.has_file:
            layer_shard_files(step_dir, layer.index, saved_tp)  # every shard is there, else the missing one named
            yield step_dir, saved_tp, layer, keys[layer.index]


def _check_keys(step_dir: str, index: int, found, keys: dict[str, str]) -> None:
    if set(found) != set(keys):
        diff = sorted(set(found) ^ set(keys))
        path = os.path.join(step_dir, layer_file_name(index))
        raise CheckpointError(f"{path}: keys {diff} do not match the layout of this model")


def plan_hf_tensors(ckpt_dir: str, config, tag: str | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF key, shape, dtype) of every weight in `iter_hf_tensors` order; reads no tensor data."""
    plan = []
    for step_dir, saved_tp, layer, keys in _layers(ckpt_dir, config, tag):
        specs = [layer_tensor_specs(f) for f in layer_shard_files(step_dir, layer.index, saved_tp)]
        _check_keys(step_dir, layer.index, specs[0], keys)
        for ours, hf in keys.items():
            shape = merged_shape([s[ours][0] for s in specs], tp_split(layer.kind, ours), config.vocab_size)
            plan.append((hf, shape, specs[0][ours][1]))
    return plan


def iter_layer_states(ckpt_dir: str, config, tag: str | None = None):
    """Yield (layer index, {our key: HF key}, {our key: whole tensor}) one layer at a time."""
    for step_dir, saved_tp, layer, keys in _layers(ckpt_dir, config, tag):
        state = load_layer_whole(step_dir, layer, config.vocab_size, saved_tp)
        _check_keys(step_dir, layer.index, state, keys)
        yield layer.index, keys, state


def iter_hf_tensors(
    ckpt_dir: str, config, tag: str | None = None, adapters: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor) for every weight of the checkpoint, reading one layer at a time.

    With tied embeddings `lm_head.weight` is not yielded (HF re-ties it on load).

    Args:
        ckpt_dir: pipeline checkpoint.
        config: its transformers config.
        tag: default: the one in `latest`.
        adapters: {layer index: {module: LoraDelta}} merged into the weights on the way.
    """
    from models.lora import merge_adapter

    for index, keys, state in iter_layer_states(ckpt_dir, config, tag):
        if adapters and index in adapters:
            state = merge_adapter(state, adapters[index])
        for ours, hf in keys.items():
            yield hf, state.pop(ours)


def load_hf_state_dict(ckpt_dir: str, config, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model in HF key names (for small models and tests)."""
    state = dict(iter_hf_tensors(ckpt_dir, config, tag))
    if config.tie_word_embeddings:
        state.setdefault(KEY_TABLE[LM_HEAD]["weight"], state[KEY_TABLE[EMBED]["weight"]])
    return state
