"""Fused experts stored one key per expert: read into the family's fused hub layout at conversion.

Some families keep each sparse layer's experts fused on the hub as transformers keeps them in memory
(`MoeSpec.hub_fused`; Qwen3.5-MoE's and Mistral Small 4's official checkpoints: `mlp.experts.gate_up_proj`
[E, 2I, H], gate rows then up rows, and `mlp.experts.down_proj` [E, H, I]), and so do our layer files and exports.
The same models saved by transformers' `save_pretrained` can hold one key per expert instead (its checkpoint
conversion mapping for Qwen3.5-MoE splits them on save: `mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj`,
`down_proj` [H, I]). Conversion reads such a checkpoint too: each fused tensor is stacked from its experts' keys as
they arrive (checkpoint/dequantize.py `plain_tensors`, each piece dequantized first where it is FP8), into the fused
tensor allocated once: that tensor and one piece are held at a time. Only the
[E, 2I, H] layout: the x @ W families (Llama 4, gpt-oss) have no per-expert form in transformers.
"""

from __future__ import annotations

import functools
import re

import torch

from models.families import FAMILIES, family_of


def _fused_parts(config) -> dict[str, tuple[str, ...]] | None:
    """{fused key suffix: its per-expert key templates ({e}: the expert)} of the family, or None where its experts
    are not fused [E, 2I, H] on the hub."""
    return _fused_parts_of(family_of(config).moe)


def _fused_parts_of(moe) -> dict[str, tuple[str, ...]] | None:
    if moe is None or not moe.hub_fused or moe.block != "mlp" or moe.interleaved_gate_up or moe.hub_block != "mlp":
        return None
    gate, up, down = moe.expert_names
    per = "mlp.experts.{e}.{name}.weight"
    return {
        "mlp.experts.gate_up_proj": (per.replace("{name}", gate), per.replace("{name}", up)),
        "mlp.experts.down_proj": (per.replace("{name}", down),),
    }


def per_expert_sources(hf_key: str, config, present) -> list[str] | None:
    """The per-expert hub keys that hold fused tensor `hf_key` (`present`: the checkpoint's keys), in stacking order
    (expert 0's gate then up, expert 1's, ...), or None where `hf_key` is stored as it is (or not at all)."""
    parts = _fused_parts(config)
    if parts is None or hf_key in present:
        return None
    for suffix, templates in parts.items():
        if hf_key.endswith(suffix):
            prefix = hf_key[: -len(suffix)]
            experts = getattr(config, family_of(config).moe.num_experts)
            keys = [prefix + t.format(e=e) for e in range(experts) for t in templates]
            return keys if keys[0] in present else None
    return None


def has_expert_parts(config) -> bool:
    """Whether the family's fused hub tensors may come one key per expert."""
    return _fused_parts(config) is not None


@functools.cache
def _part_pattern(family: str) -> re.Pattern:
    parts = _fused_parts_of(FAMILIES[family].moe)
    names = "|".join(re.escape(t.split("{e}.")[1]) for templates in parts.values() for t in templates)
    return re.compile(rf"\.mlp\.experts\.\d+\.(?:{names})$")


def is_expert_part(hf_key: str, config) -> bool:
    """Whether `hf_key` is one expert's piece of a fused hub tensor (put in place by `Assembly`)."""
    return has_expert_parts(config) and _part_pattern(family_of(config).model_type).search(hf_key) is not None


class Assembly:
    """One fused hub tensor filled from its experts' pieces as they arrive, in any order (`per_expert_sources`:
    each expert's gate rows then its up rows, the experts along dim 0): allocated at the first piece, each piece
    copied into its place, so that only the fused tensor and one piece are held."""

    def __init__(self, sources: list[str], config):
        self.place = {src: i for i, src in enumerate(sources)}
        self.experts = getattr(config, family_of(config).moe.num_experts)
        self.per_expert, self.left, self.out = len(sources) // self.experts, len(sources), None

    def add(self, name: str, piece: torch.Tensor) -> torch.Tensor | None:
        """Put `name`'s piece in place; the fused tensor once every piece has arrived, else None."""
        expert, part = divmod(self.place[name], self.per_expert)
        rows = piece.shape[0]
        if self.out is None:
            self.out = torch.empty(self.experts, self.per_expert * rows, *piece.shape[1:], dtype=piece.dtype)
        self.out[expert, part * rows : (part + 1) * rows] = piece
        self.left -= 1
        return self.out if self.left == 0 else None


def fuse_per_expert(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A state dict with one key per expert in the family's fused hub layout (the same model as its official
    checkpoints store it); any other state dict unchanged."""
    parts = _fused_parts(config)
    if parts is None:
        return state
    out, used = {}, set()
    for key in state:
        match = re.match(r"(.*\.mlp\.experts\.)0\.", key)
        if match is None or key.startswith("mtp."):  # (Qwen3.5's multi-token-prediction layer: carried as it is)
            continue
        prefix = match.group(1).removesuffix("mlp.experts.")
        for suffix in parts:
            sources = per_expert_sources(prefix + suffix, config, state)
            if sources and prefix + suffix not in out:
                assembly = Assembly(sources, config)
                out[prefix + suffix] = [assembly.add(k, state[k]) for k in sources][-1]
                used.update(sources)
    return ({k: v for k, v in state.items() if k not in used} | out) if used else state
