"""Read a pipeline checkpoint back into Hugging Face key names, one layer file at a time."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from checkpoint.errors import CheckpointError
from checkpoint.layer_files import find_layer_file, load_layer_state
from checkpoint.names import engine_files
from checkpoint.safe_load import check_pickles
from checkpoint.saves import read_tag
from models.layout import EMBED, KEY_TABLE, LM_HEAD, all_layer_keys, layer_file_name


def _layer_files(ckpt_dir: str, config, tag: str | None):
    """(path, {our key: HF key}) per layer file, in layer order."""
    step_dir = os.path.join(ckpt_dir, read_tag(ckpt_dir, tag))
    if os.path.isdir(step_dir):  # engine files are not needed here, but one that is unsafe means a tampered checkpoint
        check_pickles(step_dir, engine_files(os.listdir(step_dir)))
    for index, keys in all_layer_keys(config).items():
        path = find_layer_file(step_dir, index)
        if path is None:
            raise CheckpointError(f"{os.path.join(step_dir, layer_file_name(index))}: layer file missing")
        yield path, keys


def _load_layer(path: str, keys: dict[str, str], mmap: bool) -> dict[str, torch.Tensor]:
    state = load_layer_state(path, mmap=mmap)
    if set(state) != set(keys):
        diff = sorted(set(state) ^ set(keys))
        raise CheckpointError(f"{path}: keys {diff} do not match the layout of this model")
    return state


def plan_hf_tensors(ckpt_dir: str, config, tag: str | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF key, shape, dtype) of every weight in `iter_hf_tensors` order; reads no tensor data (mmap)."""
    plan = []
    for path, keys in _layer_files(ckpt_dir, config, tag):
        state = _load_layer(path, keys, mmap=True)
        plan += [(hf, tuple(state[ours].shape), state[ours].dtype) for ours, hf in keys.items()]
        del state
    return plan


def iter_layer_states(ckpt_dir: str, config, tag: str | None = None):
    """Yield (layer index, {our key: HF key}, {our key: tensor}) one layer file at a time."""
    for index, (path, keys) in zip(all_layer_keys(config), _layer_files(ckpt_dir, config, tag)):
        yield index, keys, _load_layer(path, keys, mmap=False)


def iter_hf_tensors(
    ckpt_dir: str, config, tag: str | None = None, adapters: dict | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF key, tensor) for every weight of the checkpoint, reading one layer file at a time.

    With tied embeddings `lm_head.weight` is not yielded (HF re-ties it on load).

    Args:
        ckpt_dir: pipeline checkpoint.
        config: its LlamaConfig.
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
