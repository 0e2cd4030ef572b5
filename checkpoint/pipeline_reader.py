"""One way into a saved pipeline checkpoint: `PipelineCheckpoint` opens a directory once.

It resolves the tag (checkpoint/saves.py's rule), the tensor-parallel degree and the layer files, scans the
engine files' pickles once, and reports problems as data (`Problem`: a path and a reason, never a string
callers parse). Export, resharding, `--inspect`, `--verify`, generation, the LoRA merge and the trainer's
initial load all read through it. A layer written by several tensor-parallel ranks (`layer_XX-model_YY`) is
merged into whole tensors on the way (checkpoint/layer_files.py), or sliced for a rank of another degree.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from checkpoint.errors import CheckpointError, Problem
from checkpoint.hf_reader import read_model_config
from checkpoint.layer_files import (
    checkpoint_tp_size,
    find_layer_file,
    layer_shard_files,
    layer_tensor_specs,
    load_layer_shard,
    load_layer_whole,
)
from checkpoint.manifest import check_own_files
from checkpoint.names import engine_files, layer_file_name
from checkpoint.read_ahead import ReadAhead, whole_files
from checkpoint.safe_load import check_pickles
from checkpoint.saves import read_tag
from models.hub_names import hub_key
from models.key_table import KEY_TABLE, all_layer_keys
from models.pipe_layout import LM_HEAD, PipeLayer, pipe_layers
from models.sharding import merged_shape
from models.tp_rules import tp_split


class PipelineCheckpoint:
    """A pipeline checkpoint (converted or saved by the trainer) at `ckpt_dir/<tag>`, opened once.

    Args:
        ckpt_dir: the checkpoint (or run) directory.
        tag: `global_stepN`; None: `latest`, or a newer complete checkpoint (checkpoint/saves.read_tag).
        config: the model's transformers config (default: read from `ckpt_dir`).
        scan: refuse an engine file whose pickle names anything but plain data (it is not read, but one that
            is unsafe means a tampered checkpoint).
    Raises:
        CheckpointError: no such checkpoint, or (with `scan`) an unsafe file, named.
    """

    def __init__(self, ckpt_dir: str, tag: str | None = None, config=None, scan: bool = True):
        self.ckpt_dir = ckpt_dir
        self.config = config if config is not None else read_model_config(ckpt_dir)
        self.tag = read_tag(ckpt_dir, tag)
        self.step_dir = os.path.join(ckpt_dir, self.tag)
        if not os.path.isdir(self.step_dir):
            raise CheckpointError(f"{self.step_dir}: no such checkpoint")
        check_own_files(self.step_dir)  # its manifest names only its own files, none a symlink, device or FIFO
        self.names = sorted(os.listdir(self.step_dir))
        self.tp_size = checkpoint_tp_size(self.step_dir)
        layers = pipe_layers(self.config.num_hidden_layers, self.config.tie_word_embeddings)
        self.layers: list[PipeLayer] = [layer for layer in layers if layer.has_file]
        self.keys = all_layer_keys(self.config)  # {layer index: {our key: HF key}}
        if scan:
            check_pickles(self.step_dir, engine_files(self.names))

    @classmethod
    def at(cls, step_dir: str, config=None, scan: bool = True) -> PipelineCheckpoint:
        """The checkpoint whose step directory is `step_dir` (`.../global_stepN`)."""
        step_dir = os.path.abspath(step_dir)
        return cls(os.path.dirname(step_dir), os.path.basename(step_dir), config, scan)

    # ------------------------------------------------------------------ files

    def layer_files(self, index: int) -> list[str]:
        """Layer `index`'s files, one per TP rank (CheckpointError names a missing one)."""
        return layer_shard_files(self.step_dir, index, self.tp_size)

    def layer_file(self, index: int) -> str:
        """The path messages name for layer `index` (its TP rank 0 file)."""
        return find_layer_file(self.step_dir, index, 0) or os.path.join(self.step_dir, layer_file_name(index))

    def missing_files(self) -> list[Problem]:
        """Layer files that should be there and are not (every layer, every TP rank)."""
        missing = []
        for layer in self.layers:
            for tp_rank in range(self.tp_size):
                if find_layer_file(self.step_dir, layer.index, tp_rank) is None:
                    path = os.path.join(self.step_dir, layer_file_name(layer.index, tp_rank))
                    missing.append(Problem(path, "layer file missing"))
        return missing

    def unsafe_files(self, skip: set[str] = frozenset()) -> list[Problem]:
        """Every `.pt` file of the step directory but `skip` (paths), scanned: those naming more than plain data."""
        problems = []
        for name in self.names:
            path = os.path.join(self.step_dir, name)
            if name.endswith(".pt") and path not in skip and os.path.isfile(path) and not os.path.islink(path):
                try:
                    check_pickles(self.step_dir, [name])
                except CheckpointError as e:
                    problems.append(Problem(path, str(e).removeprefix(f"{path}: ")))
        return problems

    # ------------------------------------------------------------------ tensors

    def load_whole(self, layer: PipeLayer) -> dict[str, torch.Tensor]:
        """A layer's whole tensors (TP shards merged, the vocabulary without padding); memory-mapped files."""
        return load_layer_whole(self.step_dir, layer, self.config.vocab_size, self.tp_size, self.config)

    def load_shard(
        self, layer: PipeLayer, tp_rank: int = 0, tp_size: int = 1, vocab_multiple: int = 1
    ) -> dict[str, torch.Tensor]:
        """TP rank `tp_rank` of `tp_size`'s share of a layer: its own file when the degree matches, else merged
        and split again."""
        return load_layer_shard(
            self.step_dir, layer, self.config.vocab_size, self.tp_size, tp_rank, tp_size, vocab_multiple, self.config
        )

    def _check_keys(self, index: int, found) -> None:
        if set(found) != set(self.keys[index]):
            diff = sorted(set(found) ^ set(self.keys[index]))
            raise CheckpointError(f"{self.layer_file(index)}: keys {diff} do not match the key table of this model")

    def plan_hf_tensors(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(HF key, shape, dtype) of every weight in `iter_hf_tensors` order; reads no tensor data."""
        plan = []
        for layer in self.layers:
            specs = [layer_tensor_specs(f) for f in self.layer_files(layer.index)]
            self._check_keys(layer.index, specs[0])
            for ours, hf in self.keys[layer.index].items():
                rule = tp_split(layer.kind, ours, self.config)
                shape = merged_shape([s[ours][0] for s in specs], rule, self.config.vocab_size)
                plan.append((hf, shape, specs[0][ours][1]))
        return plan

    def iter_layer_states(self) -> Iterator[tuple[int, dict[str, str], dict[str, torch.Tensor]]]:
        """(layer index, {our key: HF key}, {our key: whole tensor}) one layer at a time."""
        files = [self.layer_files(layer.index) for layer in self.layers]  # every shard is there, else one named
        with ReadAhead(whole_files([f for group in files for f in group])) as ahead:  # the disk reads on meanwhile
            first = 0
            for layer, group in zip(self.layers, files):
                ahead.reached(first)
                first += len(group)
                state = self.load_whole(layer)
                self._check_keys(layer.index, state)
                yield layer.index, self.keys[layer.index], state

    def iter_hf_tensors(self, adapters: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, tensor) of every weight, one layer in memory at a time; `adapters` ({layer index: {module:
        LoraDelta}}) merged in on the way. With tied embeddings `lm_head.weight` is not yielded (HF re-ties it)."""
        from models.lora import merge_adapter

        for index, keys, state in self.iter_layer_states():
            if adapters and index in adapters:
                state = merge_adapter(state, adapters[index])
            for ours, hf in keys.items():
                yield hf, state.pop(ours)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model in HF key names (for small models and tests)."""
        state = dict(self.iter_hf_tensors())
        if self.config.tie_word_embeddings:
            embedding = all_layer_keys(self.config)[0]["weight"]  # (`model.embed_tokens.weight`, or the family's)
            state.setdefault(hub_key(self.config, KEY_TABLE[LM_HEAD]["weight"]), state[embedding])
        return state


def load_hf_state_dict(ckpt_dir: str, config=None, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model of a pipeline checkpoint in HF key names (for small models and tests)."""
    return PipelineCheckpoint(ckpt_dir, tag, config).hf_state_dict()
