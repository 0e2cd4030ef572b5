"""Batches in the pipeline's format: ((input_ids, position_ids), labels), padded to a fixed length.

Fixed length because DeepSpeed sizes its inter-stage receive buffers from the first micro-batch.
Labels are shifted here, once: labels[t] is the token at t + 1 when that token is a target,
else IGNORE_INDEX, so the loss compares logits[:, t] with labels[:, t] and never slices the
[B, S, V] logits tensor.
"""

from __future__ import annotations

import torch

from models.loss import IGNORE_INDEX


class CausalLMCollator:
    def __init__(self, seq_length: int, pad_token_id: int):
        self.seq_length = seq_length
        self.pad_token_id = pad_token_id

    def __call__(self, samples: list[tuple[torch.Tensor, torch.Tensor]]):
        batch, seq = len(samples), self.seq_length
        input_ids = torch.full((batch, seq), self.pad_token_id, dtype=torch.long)  # [B, S]
        labels = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)  # [B, S]
        for i, (ids, targets) in enumerate(samples):
            n = len(ids)
            input_ids[i, :n] = ids
            if n > 1:
                labels[i, : n - 1] = torch.where(targets[1:], ids[1:], IGNORE_INDEX)
        position_ids = torch.arange(seq, dtype=torch.long).expand(batch, seq).contiguous()  # [B, S]
        return (input_ids, position_ids), labels
