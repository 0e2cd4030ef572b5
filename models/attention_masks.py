"""Which keys each query of a pipeline decoder layer may attend: causal, within its packed document, its sliding
window or its chunk (bool masks for SDPA and eager), or flash-attn's variable-length arguments for packed rows.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import torch


def document_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool, True where query i may attend key j: j <= i and both in the same document.

    A document starts wherever `position_ids` is 0 (the collator restarts them per packed row).
    """
    document = torch.cumsum(position_ids == 0, dim=-1)  # [B, S]: 1, 1, 1, 2, 2, ...
    same = document[:, :, None] == document[:, None, :]  # [B, S, S]
    causal = torch.ones(position_ids.shape[-1], position_ids.shape[-1], dtype=torch.bool, device=position_ids.device)
    return (same & causal.tril())[:, None]


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """flash-attn's variable-length arguments for packed rows: one sequence per document of the flattened batch."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().view(-1).to(torch.int32)
    cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32, device=flat.device)])
    longest = int(cu.diff().max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def attention_mask(
    position_ids: torch.Tensor, packed: bool, window: int | None, chunk: int | None = None
) -> torch.Tensor:
    """[B or 1, 1, S, S] bool, True where query i may attend key j: j <= i, within the same packed row
    (`packed`), i - j < `window` (a sliding window, as HF's sliding-window mask), and both in the same `chunk`
    positions of their document (Llama 4's chunked attention; HF's chunked mask counts from the row's start, which
    is the document's start unless rows are packed)."""
    s = position_ids.shape[-1]
    index = torch.arange(s, device=position_ids.device)
    allowed = (index[None, :] <= index[:, None])[None, None]  # [1, 1, S, S]
    if window is not None:
        allowed = allowed & (index[:, None] - index[None, :] < window)[None, None]
    if chunk is not None:
        part = torch.div(position_ids, chunk, rounding_mode="floor")  # [B, S]
        allowed = allowed & (part[:, :, None] == part[:, None, :])[:, None]
    if packed:
        allowed = allowed & document_mask(position_ids)
    return allowed


DOCUMENT_SDPA = "sdpa_documents"  # the attention implementation `sdpa_by_document` is registered under


def document_starts(position_ids: torch.Tensor) -> list[list[int]]:
    """Each row's document starts (where `position_ids` is 0; one host read for the micro-batch's rows)."""
    return [(row == 0).nonzero().view(-1).tolist() for row in position_ids]


def sdpa_by_document(module, query, key, value, attention_mask, starts: list[list[int]] | None = None, **kwargs):
    """transformers' SDPA attention run on each packed document alone with its causal kernel (`is_causal`), so no
    [S, S] mask exists and each document's cost is its own length squared: block-diagonal causal attention, exactly.
    query/key/value [B, heads, S, head_dim]; `starts`: each row's document starts (`document_starts`); without them,
    transformers' SDPA as it is (a mask given for sliding windows and chunks)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows, seq = [], query.shape[2]
    for row, first in enumerate(starts):
        bounds = [*first, seq] if first and first[0] == 0 else [0, *first, seq]
        pieces = [
            sdpa_attention_forward(
                module, *(t[row : row + 1, :, a:b] for t in (query, key, value)), None, is_causal=True, **kwargs
            )[0]
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        rows.append(torch.cat(pieces, dim=1))  # [1, S, heads, head_dim]
    return torch.cat(rows, dim=0), None


def register_document_attention() -> None:
    """Make `sdpa_by_document` an attention implementation of transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT_SDPA, sdpa_by_document)
