"""Per-row views of `req_to_token` that every backend builds its metadata from (one copy of the logic).

An encoder-decoder request's row holds `encoder_lens[i]` encoder slots, then its decoder slots, the
decoder part starting on a fresh page. So the decoder view of row i starts at column
`encoder_lens[i]` - a per-row gather, never one batch-wide offset - and a page table of either part
takes every page_size-th slot of its view and divides by page_size.

The fast backends split that work by where the data lives (nano-vllm's pattern): every length,
offset and page position is computed on the host from the batch's *_cpu lengths (`page_runs`,
`offsets`), sent in ONE non-blocking copy (`upload`), and the device only gathers the page ids from
`req_to_token` (`gather_pages`). Nothing is read back from the device: no host sync per step.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + (b - 1)) // b


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Host lengths int [N] -> int32 [N + 1] running offsets from 0 (cu_seqlens, indptr)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


def upload(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype = torch.int32):
    """Host tensors -> device views of them (same shapes), through one buffer and ONE non-blocking copy.

    On CUDA the buffer is pinned (a fresh one each call: the caching host allocator keeps it alive
    until the copy has run), so the copy neither waits for the GPU queue nor blocks the host.
    """
    sizes = [p.numel() for p in parts]
    host = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
    torch.cat([p.reshape(-1).to(dtype) for p in parts], out=host)
    flat = host.to(device, non_blocking=True)
    return [chunk.view(p.shape) for chunk, p in zip(flat.split(sizes), parts, strict=True)]


# Page runs. A run is one request's contiguous span of req_to_token columns: `tokens` tokens from
# `first_col` on (a page boundary of the row), i.e. ceil(tokens / page_size) pages. The host describes
# runs with O(runs) numbers; the device expands them into page ids, so the host cost of a step does not
# grow with the context length. request: int32 [R] the run's index in the batch (-> req_pool_indices).


def padded_page_ids(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    request: torch.Tensor,
    first_col: torch.Tensor,
    tokens: torch.Tensor,
    width: int,
    page_size: int,
) -> torch.Tensor:
    """Page ids of R runs as a table -> int32 [R, width]; 0 (the scratch page) past a run's last page.

    req_to_token int32 [rows, C]; req_pool_indices int64 [B]; request, first_col, tokens int32 [R];
    all on the device.
    """
    step = torch.arange(0, width * page_size, page_size, dtype=torch.int32, device=req_to_token.device)
    valid = step < tokens[:, None]
    columns = torch.where(valid, first_col[:, None] + step, 0)
    slots = req_to_token[req_pool_indices[request][:, None], columns]
    return torch.where(valid, slots // page_size, 0)


def packed_page_ids(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    request: torch.Tensor,
    first_col: torch.Tensor,
    pages: torch.Tensor,
    page_starts: torch.Tensor,
    num_pages: int,
    page_size: int,
) -> torch.Tensor:
    """Page ids of R runs back to back (CSR order) -> int32 [num_pages].

    request, first_col, pages (per run), page_starts (offset of each run's first page): int32 [R] on
    the device; num_pages = sum(pages), known on the host, so no output size is read back.
    """
    run = torch.repeat_interleave(pages, output_size=num_pages)
    page = torch.arange(num_pages, dtype=torch.int32, device=req_to_token.device) - page_starts[run]
    columns = first_col[run] + page * page_size
    slots = req_to_token[req_pool_indices[request[run]], columns]
    return slots // page_size
