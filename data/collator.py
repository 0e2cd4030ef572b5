"""Batches in the pipeline's format: ((input_ids, position_ids), labels, tokens), padded to a fixed length.

Fixed length because DeepSpeed sizes its inter-stage receive buffers from the first micro-batch.
Labels are shifted here, once: labels[t] is the token at t + 1 when that token is a target of the
same row, else IGNORE_INDEX, so the loss compares logits[:, t] with labels[:, t] and never slices the
[B, S, V] logits tensor. `tokens` counts the tokens that are not padding (what throughput reports);
DeepSpeed reads only the first two entries.

Context parallelism (`context=(rank, C)`): the C ranks of a group read the same rows and each keeps its S/C
positions of input_ids and labels (and counts its own tokens); position_ids stay whole, since every layer builds
the row's mask from them (models/context_parallel.py).

Packed batches (`packing=True`): each sample is a list of rows (data/packing.py) laid end to end;
`position_ids` restart at 0 for each row and for the padding tail, which is how the decoder layers
find the row boundaries (models/layers.py), and the last token of a row predicts nothing.
"""

from __future__ import annotations

import torch

from models.context_parallel import shard
from models.loss import IGNORE_INDEX


class CausalLMCollator:
    """`lengths`: add each row's length (long [B], where its padding starts) to the inputs, for models with
    experts (their load-balancing statistics leave padding out, as transformers' do with an attention mask).
    `context`: (this rank's index, C) of its context-parallel group."""

    def __init__(
        self,
        seq_length: int,
        pad_token_id: int,
        packing: bool = False,
        lengths: bool = False,
        context: tuple[int, int] = (0, 1),
    ):
        self.seq_length = seq_length
        self.pad_token_id = pad_token_id
        self.packing = packing
        self.lengths = lengths
        self.context = context

    def __call__(self, samples: list):
        batch, seq = len(samples), self.seq_length
        input_ids = torch.full((batch, seq), self.pad_token_id, dtype=torch.long)  # [B, S]
        labels = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)  # [B, S]
        position_ids = torch.arange(seq, dtype=torch.long).expand(batch, seq).contiguous()  # [B, S]
        lengths = torch.zeros(batch, dtype=torch.long)  # [B]
        for i, sample in enumerate(samples):
            at = 0
            for ids, targets in sample if self.packing else [sample]:
                n = len(ids)
                input_ids[i, at : at + n] = ids
                if n > 1:
                    labels[i, at : at + n - 1] = torch.where(targets[1:], ids[1:], IGNORE_INDEX)
                if self.packing:
                    position_ids[i, at : at + n] = torch.arange(n)
                at += n
            if self.packing:
                position_ids[i, at:] = torch.arange(seq - at)  # the padding tail: a row of its own
            lengths[i] = at
        input_ids, labels = shard(input_ids, *self.context), shard(labels, *self.context)
        start = self.context[0] * input_ids.shape[1]
        tokens = int((lengths - start).clamp(0, input_ids.shape[1]).sum())  # this rank's positions that hold tokens
        inputs = (input_ids, position_ids, lengths) if self.lengths else (input_ids, position_ids)
        return inputs, labels, torch.tensor(tokens)
