"""Tensors a hub keeps in parts that transformers concatenates at load (models/key_table.py `hub_parts`: Kimi
Linear's `q_conv1d`, `k_conv1d`, `v_conv1d` -> `conv1d`): a decoder layer's state dict holds the parts under the
hub's keys (split along dim 0, equal parts, as transformers' save splits them) and joins them at load, so that
conversion and export stay key-for-key copies. Model code only."""

from __future__ import annotations

import torch
from torch import nn

from models.key_table import hub_parts


def part_keys(layer: nn.Module, config) -> None:
    """Give `layer` (a decoder layer, ours or transformers') the hub's keys of its tensors kept in parts."""
    parts = hub_parts(config)
    if not parts:
        return

    def to_hub(module, state_dict, prefix, local_metadata):
        for whole, pieces in parts.items():
            if prefix + whole in state_dict:
                for key, piece in zip(pieces, state_dict.pop(prefix + whole).chunk(len(pieces), 0), strict=True):
                    state_dict[prefix + key] = piece.clone()  # (its own storage: saved alone)

    def from_hub(module, state_dict, prefix, *args):
        for whole, pieces in parts.items():
            if prefix + pieces[0] in state_dict:
                state_dict[prefix + whole] = torch.cat([state_dict.pop(prefix + key) for key in pieces], 0)

    layer.register_state_dict_post_hook(to_hub)
    layer.register_load_state_dict_pre_hook(from_hub)
