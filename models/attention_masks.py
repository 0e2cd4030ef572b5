"""Which keys each query of a pipeline decoder layer may attend: causal, within its packed document, its sliding
window or its chunk: as dense bool masks (eager; SDPA under context parallelism), as SDPA run on each segment alone
without a mask (`sdpa_by_document`), or as flash-attn's variable-length arguments for packed rows.

Model code only: no DeepSpeed, no distributed code.
"""

from __future__ import annotations

import contextlib

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
BAND_QUERIES = 1024  # queries a sliding window's band attends at once: its mask is BAND_QUERIES x (that + window)


def document_starts(position_ids: torch.Tensor, chunk: int | None = None) -> list[list[int]]:
    """Each row's segments that attend alone: its documents (starting where `position_ids` is 0) and, with `chunk`,
    each chunk of them (Llama 4's chunked attention: a chunk starts where a document's position is a multiple of
    `chunk`); one host read for the micro-batch's rows."""
    starts = position_ids == 0 if chunk is None else position_ids % chunk == 0
    return [row.nonzero().view(-1).tolist() for row in starts]


def _sdpa(query, key, value, mask, dropout: float = 0.0, scaling: float | None = None):
    """torch's SDPA on [B, heads, L, head_dim] with a mask over GQA's key heads as they are (`enable_gqa`: no
    repeated copies of the keys kept for backward); [B, L, heads, head_dim] as transformers' attention returns it."""
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
    )
    return out.transpose(1, 2)


def band_mask(window: int, span: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[span, span + window - 1] additive mask, 0 where key (a - window + 1 + col) is in the window of query (a + row):
    every band of `span` queries takes a view of it (in the queries' dtype: SDPA would turn a bool mask into a new
    one for every band), so backward keeps one mask a layer, not one a band."""
    row = torch.arange(span, device=device)[:, None]
    col = torch.arange(span + window - 1, device=device)[None, :]
    allowed = (col >= row) & (col <= row + window - 1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def _banded(query, key, value, window: int, shared: torch.Tensor, **kwargs) -> torch.Tensor:
    """Causal attention within a sliding `window` (key j for query i where 0 <= i - j < window) over one segment,
    `shared`'s rows of queries at a time against the keys their window reaches (`band_mask`; the first bands' keys
    cut at the segment's start): memory and work linear in the segment."""
    length, span = query.shape[2], shared.shape[0]
    pieces = []
    for a in range(0, length, span):
        b, first, base = min(a + span, length), max(0, a - window + 1), a - window + 1
        kv = (key[:, :, first:b], value[:, :, first:b])
        mask = shared[: b - a, first - base : b - base]
        pieces.append(_sdpa(query[:, :, a:b], *kv, mask, kwargs.get("dropout", 0.0), kwargs.get("scaling")))
    return torch.cat(pieces, dim=1)


def sdpa_by_document(
    module, query, key, value, attention_mask, starts: list[list[int]] | None = None, window: int | None = None, **kw
):
    """transformers' SDPA attention run on each packed document (and each of its chunks) alone, with the causal
    kernel (`is_causal`), or within a sliding `window` by bands of queries (`_banded`): no [S, S] mask exists and a
    segment costs its own length squared, or its length times the window. Exactly the block-diagonal, windowed or
    chunked causal attention of the dense masks (`attention_mask`). query/key/value [B, heads, S, head_dim];
    `starts`: each row's segment starts (`document_starts`); without them, transformers' SDPA as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if starts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)
    kw.pop("is_causal", None)
    seq, shared = query.shape[2], None
    same = all(first == starts[0] for first in starts)  # (unpacked rows: every row's segments alike, one pass)
    rows = []
    for row, first in enumerate(starts[:1] if same else starts):
        bounds = [*first, seq] if first and first[0] == 0 else [0, *first, seq]
        picked = slice(None) if same else slice(row, row + 1)
        pieces = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (t[picked, :, a:b] for t in (query, key, value))
            if window is not None and b - a > window:
                if shared is None:  # (one for the layer's every band)
                    shared = band_mask(window, min(BAND_QUERIES, seq), query.dtype, query.device)
                pieces.append(_banded(q, k, v, window, shared, **kw))
            else:
                pieces.append(sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kw)[0])
        rows.append(torch.cat(pieces, dim=1))  # [rows, S, heads, head_dim]
    return torch.cat(rows, dim=0), None


def register_document_attention() -> None:
    """Make `sdpa_by_document` an attention implementation of transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(DOCUMENT_SDPA, sdpa_by_document)


@contextlib.contextmanager
def document_temperature(attention, position_ids: torch.Tensor, offset: int = 0):
    """Llama 4's NoPE layers scale each query by a temperature of its position, which transformers counts from the
    row's start (`arange(S)` + the cache's length, `offset` under context parallelism): on packed rows a document's
    tokens count from the document's own start, as when it is alone. Within this context the query projection's
    output is scaled by the ratio of the two temperatures (1 wherever they agree: below `floor_scale` positions)."""

    def temperature(positions: torch.Tensor) -> torch.Tensor:
        steps = torch.floor((positions.float() + 1.0) / attention.floor_scale)
        return torch.log1p(steps) * attention.attn_scale + 1.0

    def rescale(_module, _inputs, query: torch.Tensor) -> torch.Tensor:
        row = torch.arange(position_ids.shape[-1], device=position_ids.device) + offset
        return query * (temperature(position_ids) / temperature(row))[..., None].to(query.dtype)

    handle = attention.q_proj.register_forward_hook(rescale)
    try:
        yield
    finally:
        handle.remove()
