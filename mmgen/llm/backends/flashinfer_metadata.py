"""FlashInfer metadata: the page layouts and masks its wrappers are planned with, for one step.

One pure computation, `compute_flashinfer_metadata(batch, req_to_token, page_size, sliding_window_left)`,
serves eager runs and CUDA-graph replay (on replay the graph-mode wrappers' plan() copies its result
into the static buffers they were built over, as FlashInfer's CUDA-graph mode does).

Where things live: FlashInfer's plan() reads qo_indptr, the page indptr and last_page_len on the
host (a device tensor there costs a device->host sync per plan), while the kernels read the page
indices on the device. So those small arrays stay host tensors, and the indices of every call of
the step come from one host->device copy and one gather (layout.py): no value is read back.

Wrapper sets: the sliding-window layers get their own plans (window_left, KV trimmed to the keys a
window can reach); the global layers and the cross-attention layers form the other set (global self
attention over the whole decoder KV, cross attention over each request's own encoder pages).

Extend-like modes split each self-attention call in two, merged with `merge_state`:
- ragged: the step's new tokens against themselves, causal (+ window_left);
- paged: the cached prefix, non-causal (+ window_left). For sliding layers the prefix is trimmed to
  the keys the request's first new token can still see (from a page boundary) and a bool custom mask
  keeps each query to the keys inside its own window: the kernel aligns queries to the end of the
  trimmed prefix, so window_left alone would let later queries see keys they must not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mmgen.llm.backends.layout import ceil_div, offsets, packed_page_ids, upload
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode

SET_ORDER = ("full", "sliding", "cross")


@dataclass(frozen=True)
class PagedLayout:
    """FlashInfer's CSR page layout of one call: request i reads pages indices[indptr[i]:indptr[i+1]].

    indices: int32 [nnz_pages] on the device. Host int32 tensors: indptr [B + 1]; last_page_len [B]
    (page_size for a request with no pages); kv_lens [B] tokens read; kv_start [B] decoder (or
    encoder) position of the first token read (> 0 where a sliding window trimmed the front).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    kv_start: torch.Tensor


def window_start(first_query_pos: torch.Tensor, window_left: int, page_size: int) -> torch.Tensor:
    """First key position any query of a request can see, rounded down to a page boundary."""
    if window_left < 0:
        return torch.zeros_like(first_query_pos)
    first = (first_query_pos - window_left).clamp_min(0)
    return first // page_size * page_size


def window_mask(
    q_lens: torch.Tensor, prefix_lens: torch.Tensor, kv_start: torch.Tensor, window_left: int
) -> torch.Tensor:
    """Flattened bool custom mask over [q_lens[i], prefix_lens[i] - kv_start[i]] blocks (host int32 [B]).

    Query q of request i sits at decoder position prefix_i + q; it may see prefix key position p
    (p = kv_start_i + column) iff p >= prefix_i + q - window_left. Row-major per request, concatenated.
    """
    keys = (prefix_lens - kv_start).long()
    sizes = q_lens.long() * keys
    total = int(sizes.sum())
    block = torch.repeat_interleave(torch.arange(sizes.numel()), sizes, output_size=total)
    local = torch.arange(total) - offsets(sizes).long()[block]
    width = keys[block]  # > 0 inside any block that has entries
    query, column = local // width, local % width
    return kv_start.long()[block] + column >= prefix_lens.long()[block] + query - window_left


@dataclass(frozen=True)
class WrapperSetPlan:
    """What one wrapper set's self-attention calls are planned with for this step.

    paged: decode -> the KV each request reads; extend-like -> its cached prefix (None when no request
    has a prefix: the ragged call alone covers the step). custom_mask: flattened bool mask of the
    paged prefix call (sliding set in extend-like modes only), on the device.
    """

    window_left: int
    paged: PagedLayout | None
    custom_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class FlashInferMetadata:
    """FlashInfer plans of one step. qo_indptr: host int32 [B + 1] offsets of the step's query tokens."""

    forward_mode: ForwardMode
    batch_size: int
    page_size: int
    qo_indptr: torch.Tensor
    q_lens_cpu: torch.Tensor
    is_decode: bool
    full: WrapperSetPlan
    sliding: WrapperSetPlan | None
    cross: PagedLayout | None

    def plan_for(self, window_left: int) -> WrapperSetPlan:
        """The wrapper set a self-attention layer with this window_left runs on."""
        if window_left < 0:
            return self.full
        if self.sliding is None or self.sliding.window_left != window_left:
            have = None if self.sliding is None else self.sliding.window_left
            raise KeyError(f"no FlashInfer plan for window_left={window_left} (sliding set has {have})")
        return self.sliding


def compute_flashinfer_metadata(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    sliding_window_left: int | None,
) -> FlashInferMetadata:
    """The one metadata computation of the FlashInfer backend.

    sliding_window_left: the window_left of the model's sliding-window layers (None: no such layers).
    Each paged call reads, per request, tokens [start, end) of a row part: decode -> the decoder KV
    [window start, extent); extend-like -> the cached prefix [window start, prefix); cross -> the
    encoder part [0, encoder_len). The pages of all of them are found in one pass (_paged_layouts).
    """
    b = batch.batch_size
    device = req_to_token.device
    q_lens = batch.query_lens_cpu().to(torch.int32)
    extent = batch.kv_extent_cpu().to(torch.int32)
    is_decode = batch.forward_mode is ForwardMode.DECODE
    prefix = extent - q_lens  # decoder position of each request's first new token
    zeros = torch.zeros(b, dtype=torch.int32)
    enc = None
    if batch.encoder_lens is not None:
        assert batch.encoder_lens_cpu is not None
        enc = batch.encoder_lens_cpu.to(torch.int32)
    dec_first_col = zeros if enc is None else enc
    end = extent if is_decode else prefix
    reads_kv = is_decode or bool((prefix > 0).any())
    windows = {"full": -1}
    if sliding_window_left is not None and sliding_window_left >= 0:
        windows["sliding"] = sliding_window_left
    # (part's first column, start, end) per request of every paged call the step makes.
    calls = {}
    if reads_kv:
        for name, left in windows.items():
            calls[name] = (dec_first_col, window_start(prefix, left, page_size), end)
    if enc is not None:
        calls["cross"] = (zeros, zeros, enc)
    layouts = _paged_layouts(calls, batch.req_pool_indices, req_to_token, page_size, b)
    plans = {}
    for name, left in windows.items():
        layout = layouts.get(name)
        mask = None
        if layout is not None and left >= 0 and not is_decode:
            mask = window_mask(q_lens, prefix, layout.kv_start, left)
            (mask,) = upload([mask], device, torch.bool)
        plans[name] = WrapperSetPlan(left, layout, mask)
    return FlashInferMetadata(
        forward_mode=batch.forward_mode,
        batch_size=b,
        page_size=page_size,
        qo_indptr=offsets(q_lens),
        q_lens_cpu=q_lens,
        is_decode=is_decode,
        full=plans["full"],
        sliding=plans.get("sliding"),
        cross=layouts.get("cross"),
    )


def _paged_layouts(
    calls: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    page_size: int,
    b: int,
) -> dict[str, PagedLayout]:
    """PagedLayouts of every call; their indices come from one upload and one expansion on the device.

    Host work is on [calls, B] tensors (one row per call), whatever the context length.
    """
    if not calls:
        return {}
    part, start, stop = (torch.stack(rows) for rows in zip(*calls.values(), strict=True))
    lens = (stop - start).clamp_min(0)
    pages = ceil_div(lens, page_size)
    indptr = torch.zeros(len(calls), b + 1, dtype=torch.int32)
    torch.cumsum(pages, dim=1, out=indptr[:, 1:])
    bounds = offsets(indptr[:, -1])  # where each call's pages begin in the packed indices
    runs = torch.stack(
        [
            torch.arange(b, dtype=torch.int32).expand_as(part),
            part + start,
            pages,
            indptr[:, :-1] + bounds[:-1, None],
        ]
    )
    bounds = bounds.tolist()
    (dev_runs,) = upload([runs.view(4, -1)], req_to_token.device)
    request, first_col, run_pages, run_starts = dev_runs
    indices = packed_page_ids(
        req_to_token, req_pool_indices, request, first_col, run_pages, run_starts, bounds[-1], page_size
    )
    # A request with no pages reads nothing whatever last_page_len says, but FlashInfer derives the
    # custom-mask offsets from (pages - 1) * page_size + last_page_len: page_size keeps that at 0.
    last = torch.where(lens > 0, (lens - 1) % page_size + 1, page_size)
    return {
        name: PagedLayout(indptr[i], indices[bounds[i] : bounds[i + 1]], last[i], lens[i], start[i])
        for i, name in enumerate(calls)
    }


def layout_tensors(layout: PagedLayout) -> dict[str, torch.Tensor]:
    """The layout's tensors by field name (equality checks)."""
    return {f.name: getattr(layout, f.name) for f in fields(layout)}


class _LayoutBuffers:
    """Device home of one PagedLayout in CUDA-graph mode: max_bs requests of up to max_pages pages each."""

    def __init__(self, max_bs: int, max_pages: int, device: torch.device | str) -> None:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.indptr = z(max_bs + 1)
        self.indices = z(max_bs * max_pages)
        self.last_page_len = z(max_bs)


class FlashInferStaticBuffers:
    """Fixed-address device buffers the graph-mode wrappers are built over (FlashInfer's CUDA-graph mode).

    A graph-mode wrapper's plan() copies the step's metadata into them (indptr, indices,
    last_page_len, qo_indptr, the packed custom mask and its offsets); the captured kernels read them.
    """

    def __init__(
        self, max_bs: int, max_pages: int, max_tokens: int, max_context: int, device: torch.device | str
    ) -> None:
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.layouts = {name: _LayoutBuffers(max_bs, max_pages, device) for name in SET_ORDER}
        self.ragged_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.packed_mask = torch.zeros(
            max_tokens * max_context // 8 + max_bs + 1, dtype=torch.uint8, device=device
        )
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
