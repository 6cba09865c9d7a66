"""Per-row views of `req_to_token` that every backend builds its metadata from (one copy of the logic).

An encoder-decoder request's row holds `encoder_lens[i]` encoder slots, then its decoder slots, the
decoder part starting on a fresh page. So the decoder view of row i starts at column
`encoder_lens[i]` - a per-row gather, never one batch-wide offset - and a page table of either part
takes every page_size-th slot of its view and divides by page_size. Pure tensor ops, no host sync:
usable in CUDA-graph replay on static buffers.
"""

from __future__ import annotations

import torch


def decoder_token_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    encoder_lens: torch.Tensor | None,
    width: int,
) -> torch.Tensor:
    """Decoder slots of each row: out[i, j] = req_to_token[req_i, encoder_lens[i] + j] -> int32 [B, width].

    Columns past the row's end repeat its last column (callers only read j < the request's extent).
    """
    rows = req_pool_indices.long()[:, None]
    cols = torch.arange(width, device=req_to_token.device)[None, :]
    if encoder_lens is not None:
        cols = cols + encoder_lens.long()[:, None]
    return req_to_token[rows, cols.clamp_max(req_to_token.shape[1] - 1)]


def encoder_token_table(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, width: int
) -> torch.Tensor:
    """Encoder slots of each row: the first `width` columns -> int32 [B, width]."""
    return req_to_token[req_pool_indices.long(), :width]


def page_table(token_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pages of a page-contiguous token table [B, width] -> int32 [B, ceil(width / page_size)]."""
    return token_table[:, ::page_size] // page_size
