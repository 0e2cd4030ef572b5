"""DeepSeek-V3's auxiliary-loss-free expert balancing across the ranks of a run (`moe.bias_update_rate`).

Each sparse layer counts, during the step's forwards, the tokens its router sent to each expert (models/layers.py,
models/moe.py `count_chosen`). After the optimizer step the counts of the ranks that hold the same layers on
different data (the data-parallel group: DP x CP, expert-parallel ranks among them) are summed into the whole
global batch's loads, and every such rank moves its copy of the router's score bias by the same amount
(`models.moe.balance`), so the bias stays identical on every rank and equal to a single process's on the same
batches, whatever the layout (tests/test_training.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.moe import balance, router_of


def balance_experts(module, rate: float, data_group, cp_size: int) -> None:
    """Update every sparse layer's score bias of this stage from the step's counts, then reset them. Collective
    over `data_group` (every rank of it holds the same layers)."""
    layers = [m for m in module.modules() if getattr(m, "expert_counts", None) is not None]
    if not layers:
        return
    counts = torch.stack([m.expert_counts for m in layers])
    dist.all_reduce(counts, group=data_group)
    counts /= cp_size  # each CP rank counted its group's whole rows (integers: exact)
    for layer, layer_counts in zip(layers, counts):
        balance(router_of(layer.moe_block(), layer.model_config), layer_counts, rate)
        layer.expert_counts = None
