"""Paged KV memory: request rows (`req_to_token`), a page allocator, and the per-layer K/V buffers.

Slot = page * page_size + offset. Page 0 is never handed out: it is the scratch page that padded
tokens of a CUDA-graph batch may write to without touching a live request. An encoder-decoder
request's row holds its encoder slots first (`encoder_len` columns), then its decoder slots; the
decoder part starts on a fresh page, so both parts are page-contiguous and a page table of either
part is the per-row gather `req_to_token[row, start + p * page_size] // page_size`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmgen.errors import MmgenError


class ReqToTokenPool:
    """Rows of `req_to_token` int32 [max_reqs, max_context]: column -> KV slot of one request."""

    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_reqs - 1, -1, -1))
        self._in_use: set[int] = set()

    def num_free(self) -> int:
        return len(self._free_rows)

    def can_allocate(self, count: int = 1) -> bool:
        return len(self._free_rows) >= count

    def allocate(self) -> int:
        if not self._free_rows:
            raise MmgenError(f"req_to_token pool: all {self.max_reqs} rows are in use")
        row = self._free_rows.pop()
        self._in_use.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._in_use:
            raise MmgenError(f"req_to_token pool: row {row} freed but not in use")
        self._in_use.remove(row)
        self._free_rows.append(row)


class PageAllocator:
    """Hands out page ids 1..num_pages (page 0 is the reserved scratch page)."""

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = num_pages
        self.page_size = page_size
        self._free_pages = list(range(num_pages, 0, -1))
        self._in_use: set[int] = set()

    def num_free(self) -> int:
        return len(self._free_pages)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return len(self._free_pages) >= num_pages

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise MmgenError(f"page allocator: {num_pages} pages asked, {len(self._free_pages)} free")
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._in_use:
                raise MmgenError(f"page allocator: page {page} freed but not in use")
            self._in_use.remove(page)
            self._free_pages.append(page)


def slots_of_pages(pages: list[int], page_size: int, num_tokens: int, device: str | torch.device = "cpu"):
    """The first num_tokens slots of the given pages, in order -> int32 [num_tokens]."""
    page_ids = torch.tensor(pages, dtype=torch.int32, device=device)
    offsets = torch.arange(page_size, dtype=torch.int32, device=device)
    return (page_ids[:, None] * page_size + offsets[None, :]).reshape(-1)[:num_tokens]


class KVPool:
    """Per-layer K and V buffers [num_slots, kv_heads, head_dim], num_slots = (num_pages + 1) * page_size.

    `layer_id` indexes the buffer. For the encoder-decoder model, decoder layer i's self-attention
    and cross-attention share buffer i: the request's encoder slots hold that layer's cross-attention
    K/V (written once per request), its decoder slots hold the self-attention K/V.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ):
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_slots = (num_pages + 1) * page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (self.num_slots, kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [n, kv_heads, head_dim] to slots loc [n] of layer layer_id."""
        self.k_buffers[layer_id][loc.long()] = k.to(self.dtype)
        self.v_buffers[layer_id][loc.long()] = v.to(self.dtype)

    def k_pages(self, layer_id: int) -> torch.Tensor:
        """Layer layer_id's K buffer viewed as pages [num_pages + 1, page_size, kv_heads, head_dim]."""
        return self.k_buffers[layer_id].view(-1, self.page_size, self.kv_heads, self.head_dim)

    def v_pages(self, layer_id: int) -> torch.Tensor:
        """Layer layer_id's V buffer viewed as pages [num_pages + 1, page_size, kv_heads, head_dim]."""
        return self.v_buffers[layer_id].view(-1, self.page_size, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class RequestAllocation:
    """One request's memory: its req_to_token row and the pages of its encoder and decoder parts."""

    row: int
    encoder_len: int
    decoder_capacity: int
    pages: tuple[int, ...]


class RequestMemory:
    """Allocates an encoder-decoder request's row and pages and fills its req_to_token row.

    Row layout: columns [0, encoder_len) = encoder slots, then decoder_capacity decoder slots that
    start on a fresh page (the encoder's last page is never shared with the decoder part).
    """

    def __init__(self, req_pool: ReqToTokenPool, pages: PageAllocator):
        self.req_pool = req_pool
        self.page_allocator = pages
        self.page_size = pages.page_size

    def pages_needed(self, encoder_len: int, decoder_capacity: int) -> int:
        return self.page_allocator.pages_for(encoder_len) + self.page_allocator.pages_for(decoder_capacity)

    def can_allocate(self, encoder_len: int, decoder_capacity: int) -> bool:
        return self.req_pool.can_allocate() and self.page_allocator.can_allocate(
            self.pages_needed(encoder_len, decoder_capacity)
        )

    def allocate(self, encoder_len: int, decoder_capacity: int) -> RequestAllocation:
        if encoder_len + decoder_capacity > self.req_pool.max_context:
            raise MmgenError(
                f"request needs {encoder_len + decoder_capacity} req_to_token columns "
                f"(encoder {encoder_len} + decoder {decoder_capacity}), rows hold {self.req_pool.max_context}"
            )
        if not self.can_allocate(encoder_len, decoder_capacity):
            raise MmgenError(
                "request memory: no free row or not enough free pages (check can_allocate first)"
            )
        row = self.req_pool.allocate()
        device = self.req_pool.req_to_token.device
        enc_pages = self.page_allocator.allocate(self.page_allocator.pages_for(encoder_len))
        dec_pages = self.page_allocator.allocate(self.page_allocator.pages_for(decoder_capacity))
        table = self.req_pool.req_to_token
        table[row, :encoder_len] = slots_of_pages(enc_pages, self.page_size, encoder_len, device)
        table[row, encoder_len : encoder_len + decoder_capacity] = slots_of_pages(
            dec_pages, self.page_size, decoder_capacity, device
        )
        return RequestAllocation(row, encoder_len, decoder_capacity, tuple(enc_pages + dec_pages))

    def free(self, allocation: RequestAllocation) -> None:
        self.page_allocator.free(list(allocation.pages))
        self.req_pool.free(allocation.row)
