"""Hub names transformers renames at load and back at save (`Family.hub_renames`: its conversion mapping's
`WeightRenaming`s): DeepSeek-V4's `attn.wq_a`, Nemotron-H's `backbone.`, Kimi Linear's `block_sparse_moe` and forget
gate. models/key_table.py names a family's hub keys through these. Model code only; below the key table."""

from __future__ import annotations

import functools
import re

from models.families import family_of
from models.layer_kinds import is_sparse_layer


@functools.cache
def _renamings(model_type: str) -> tuple[list, list]:
    """transformers' key renames of a family (its conversion mapping's `WeightRenaming`s: hub name -> in-memory
    name), and the same reversed as its `save_pretrained` applies them (in-memory -> hub)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    forward = [t for t in get_checkpoint_conversion_mapping(model_type) or [] if isinstance(t, WeightRenaming)]
    return forward, [t.reverse_transform() for t in reversed(forward)]


def hub_key(config, key: str) -> str:
    """The hub's name of transformers' in-memory key `key` (`model.layers.0.self_attn.q_a_proj.weight` ->
    `model.layers.0.attn.wq_a.weight`), as its `save_pretrained` writes it (`Family.hub_renames`); other families'
    keys are the same in both."""
    family = family_of(config)
    if not family.hub_renames:
        return key
    from transformers.core_model_loading import apply_renamings

    renamings, moe = _renamings(family.model_type)[1], family.moe
    block = re.match(r"model\.layers\.(\d+)\.", key)
    if block and moe is not None and int(block.group(1)) < config.num_hidden_layers:
        if not is_sparse_layer(config, int(block.group(1))):  # the sparse block's own rename, not a dense MLP's
            renamings = [r for r in renamings if not _renames_the_block(r, moe)]
    return apply_renamings(key, renamings)


def saved_key(config, key: str) -> str:
    """transformers' in-memory key `key` as its `save_pretrained` writes it: every renaming reversed (`hub_key` but for
    a dense layer's MLP, which Kimi Linear's save writes under the sparse block's hub name)."""
    from transformers.core_model_loading import apply_renamings

    family = family_of(config)
    return apply_renamings(key, _renamings(family.model_type)[1]) if family.hub_renames else key


def _renames_the_block(renaming, moe) -> bool:
    """Whether a reversed renaming gives the sparse block its hub name (Kimi Linear's `.mlp.` -> `.block_sparse_moe.`):
    transformers' save applies it to a dense layer's MLP too, whose hub name is `mlp`."""
    if moe.hub_block == moe.block:
        return False
    return any(moe.hub_block in p for p in renaming.target_patterns) and any(
        moe.block in p for p in renaming.source_patterns
    )


def memory_key(config, key: str) -> str:
    """transformers' in-memory name of a hub key, as its `from_pretrained` reads it: renamed (`Family.hub_renames`),
    under `model.` where the family's release leaves it out (DeepSeek-V4's `layers.0.attn.wq_a.weight`)."""
    if not family_of(config).hub_renames:
        return key
    from transformers.core_model_loading import apply_renamings

    key = apply_renamings(key.removeprefix("model."), _renamings(family_of(config).model_type)[0])  # as the release
    return key if key.startswith(("lm_head.", "model.")) else "model." + key


def release_key(config, key: str) -> str:
    """The name a family's own release gives our table's key `key` (`memory_key` inverted: no `model.` prefix,
    `embed.weight`, `head.weight`): DeepSeek-V4's checkpoints as DeepSeek publishes them."""
    from transformers.core_model_loading import apply_renamings

    memory = memory_key(config, key)
    return apply_renamings(memory.removeprefix("model."), _renamings(family_of(config).model_type)[1])
