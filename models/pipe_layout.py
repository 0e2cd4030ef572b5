"""The pipeline layer list: which layer index holds what, for a model with L decoder blocks.

    index 0          embedding         (EMBED)
    index 1 .. L     decoder block b   (DECODER, index = b + 1)
    index L + 1      final RMSNorm     (NORM)
    index L + 2      LM head           (LM_HEAD)

With tied input/output embeddings the LM head is a second use of layer 0's module (DeepSpeed `TiedLayerSpec`): it
has no file of its own. Index arithmetic lives here only; hub key names are models/key_table.py's, layer file names
checkpoint/names.py's, tensor-parallel splits models/tp_rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

EMBED, DECODER, NORM, LM_HEAD = "embed", "decoder", "norm", "lm_head"


@dataclass(frozen=True)
class PipeLayer:
    """One entry of the pipeline layer list.

    Args:
        index: position in the `LayerSpec` list; also the number in the layer file name.
        kind: one of EMBED, DECODER, NORM, LM_HEAD.
        block: decoder block number (HF `model.layers.{block}`), None for other kinds.
        has_file: False for the tied LM head, whose weight lives in layer 0's file.
    """

    index: int
    kind: str
    block: int | None = None
    has_file: bool = True


def decoder_index(block: int) -> int:
    """Pipeline layer index of decoder block `block` (HF `model.layers.{block}`)."""
    return block + 1


def num_pipe_layers(num_layers: int) -> int:
    """Length of the pipeline layer list: embedding, `num_layers` blocks, norm, head."""
    return num_layers + 3


def pipe_layers(num_layers: int, tie_word_embeddings: bool) -> list[PipeLayer]:
    """The pipeline layer list for a model with `num_layers` decoder blocks."""
    layers = [PipeLayer(0, EMBED)]
    layers += [PipeLayer(decoder_index(b), DECODER, block=b) for b in range(num_layers)]
    layers.append(PipeLayer(num_layers + 1, NORM))
    layers.append(PipeLayer(num_layers + 2, LM_HEAD, has_file=not tie_word_embeddings))
    return layers


def block_of(index: int, num_layers: int) -> int | None:
    """The decoder block at pipeline layer `index`, or None for the embedding, norm and head."""
    return index - 1 if 1 <= index <= num_layers else None


def stage_bounds_from_blocks(blocks_per_stage: list[int]) -> list[int]:
    """Stage bounds (layer indices) from decoder blocks per stage: the embedding joins the first stage,
    the norm and head the last. Stage s owns layers [bounds[s], bounds[s + 1])."""
    bounds, blocks = [0], 0
    for n in blocks_per_stage:
        blocks += n
        bounds.append(decoder_index(blocks - 1) + 1)  # one past the stage's last block
    bounds[-1] = num_pipe_layers(blocks)
    return bounds


# The pipeline module's name for the tied embedding (DeepSpeed's TiedLayerSpec key "embed"); other
# parameters are named "<layer index>.<key inside the layer>", e.g. "5.self_attn.q_proj.weight".
TIED_KEY = "embed"
TIED_PARAM = f"tied_modules.{TIED_KEY}.weight"
