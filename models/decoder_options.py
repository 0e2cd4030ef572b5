"""How a pipeline's decoder layers run (models/layers.py): options that change no weight and no key.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.context_parallel import ContextParallel


@dataclass(frozen=True)
class DecoderOptions:
    """How decoder layers run (not what they hold: no effect on weights or keys).

    packed: rows hold several documents (position_ids restart at 0 at each); attention stays inside each.
    checkpoint_every: recompute every k-th decoder block (block % k == 0) in backward; 0 never, 1 every block.
    routed_experts: Llama 4's experts run on their routed tokens only (`moe.routed_experts`; always so with
        expert parallelism), not every expert on every token as transformers runs them.
    context: context parallelism (models/context_parallel.py): hidden holds this rank's S/C positions of each row,
        attention goes through Ulysses over `context.group` (set once the process group exists).
    mlp_tiles: > 1: a dense MLP runs its positions in this many tiles, recomputing each in backward
        (`models.context_parallel.tile_mlp`).
    """

    packed: bool = False
    checkpoint_every: int = 0
    routed_experts: bool = False
    context: ContextParallel = field(default_factory=ContextParallel, compare=False)
    mlp_tiles: int = 0

    def recompute(self, block: int) -> bool:
        return self.checkpoint_every > 0 and block % self.checkpoint_every == 0
