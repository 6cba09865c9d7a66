"""FlashInfer metadata: the page layouts and masks its wrappers are planned with, for one step.

One pure computation, `compute_flashinfer_metadata(batch, req_to_token, page_size, sliding_window_left)`,
serves eager runs and CUDA-graph replay (replay copies its result into static buffers).

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

from dataclasses import dataclass, fields, replace

import torch

from mmgen.llm.backends.flash_metadata import ceil_div, cumulative, kv_extent, page_table_rows, query_lens
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class PagedLayout:
    """FlashInfer's CSR page layout of one call: request i reads pages indices[indptr[i]:indptr[i+1]].

    indptr int32 [B + 1]; indices int32 [nnz_pages]; last_page_len int32 [B] (page_size for a request with no
    pages); kv_lens int32 [B] tokens read; kv_start int32 [B] decoder (or encoder) position of the
    first token read (> 0 where a sliding window trimmed the front).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    kv_start: torch.Tensor


def paged_layout(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    part_first_col: torch.Tensor,
    start_cpu: torch.Tensor,
    end_cpu: torch.Tensor,
    page_size: int,
) -> PagedLayout:
    """Layout of tokens [start[i], end[i]) of the row part beginning at column part_first_col[i].

    start must be a multiple of page_size (the part starts on a fresh page, so the first token read
    is then the first token of a page). Host lengths decide the shapes; gathers run on the device.
    """
    device = req_to_token.device
    start_cpu = start_cpu.to(torch.int32)
    end_cpu = end_cpu.to(torch.int32)
    if bool((start_cpu % page_size != 0).any()):
        raise ValueError(f"paged layout start {start_cpu.tolist()} not on page boundaries of {page_size}")
    lens_cpu = (end_cpu - start_cpu).clamp_min(0)
    pages_cpu = ceil_div(lens_cpu, page_size)
    width = int(pages_cpu.max()) if pages_cpu.numel() else 0
    lens = lens_cpu.to(device)
    table = page_table_rows(
        req_to_token, rows, part_first_col.to(device) + start_cpu.to(device), lens, page_size, width
    )
    valid = torch.arange(width, device=device)[None, :] < pages_cpu.to(device)[:, None]
    # A request with no pages reads nothing whatever last_page_len says, but FlashInfer derives the
    # custom-mask offsets from (pages - 1) * page_size + last_page_len: page_size keeps that at 0.
    last = torch.where(lens_cpu > 0, (lens_cpu - 1) % page_size + 1, torch.full_like(lens_cpu, page_size))
    return PagedLayout(
        indptr=cumulative(pages_cpu).to(device),
        indices=table[valid].to(torch.int32),
        last_page_len=last.to(device),
        kv_lens=lens,
        kv_start=start_cpu.to(device),
    )


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
    blocks = []
    for ql, pl, ks in zip(q_lens.tolist(), prefix_lens.tolist(), kv_start.tolist(), strict=True):
        q_pos = pl + torch.arange(ql)[:, None]
        k_pos = ks + torch.arange(pl - ks)[None, :]
        blocks.append((k_pos >= q_pos - window_left).reshape(-1))
    return torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)


@dataclass(frozen=True)
class WrapperSetPlan:
    """What one wrapper set's self-attention calls are planned with for this step.

    paged: decode -> the KV each request reads; extend-like -> its cached prefix (None when no request
    has a prefix: the ragged call alone covers the step). custom_mask: flattened bool mask of the
    paged prefix call (sliding set in extend-like modes only).
    """

    window_left: int
    paged: PagedLayout | None
    custom_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class FlashInferMetadata:
    """FlashInfer plans of one step. qo_indptr int32 [B + 1] = offsets of the step's query tokens."""

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


def _self_plan(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    window_left: int,
    dec_first_col: torch.Tensor,
    q_lens_cpu: torch.Tensor,
    extent_cpu: torch.Tensor,
) -> WrapperSetPlan:
    first_query_pos = extent_cpu - q_lens_cpu
    start = window_start(first_query_pos, window_left, page_size)
    if batch.forward_mode is ForwardMode.DECODE:
        layout = paged_layout(
            req_to_token, batch.req_pool_indices, dec_first_col, start, extent_cpu, page_size
        )
        return WrapperSetPlan(window_left, layout)
    prefix_cpu = first_query_pos
    if not bool((prefix_cpu > 0).any()):
        return WrapperSetPlan(window_left, None)
    layout = paged_layout(req_to_token, batch.req_pool_indices, dec_first_col, start, prefix_cpu, page_size)
    mask = None
    if window_left >= 0:
        mask = window_mask(q_lens_cpu, prefix_cpu, start, window_left).to(req_to_token.device)
    return WrapperSetPlan(window_left, layout, mask)


def compute_flashinfer_metadata(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    sliding_window_left: int | None,
) -> FlashInferMetadata:
    """The one metadata computation of the FlashInfer backend.

    sliding_window_left: the window_left of the model's sliding-window layers (None: no such layers).
    """
    device = req_to_token.device
    q_lens, q_lens_cpu = query_lens(batch)
    _, extent_cpu = kv_extent(batch)
    if batch.encoder_lens is not None:
        assert batch.encoder_lens_cpu is not None
        dec_first_col = batch.encoder_lens.to(torch.int32)
    else:
        dec_first_col = torch.zeros(batch.batch_size, dtype=torch.int32, device=device)
    args = (batch, req_to_token, page_size)
    full = _self_plan(*args, -1, dec_first_col, q_lens_cpu, extent_cpu)
    sliding = None
    if sliding_window_left is not None and sliding_window_left >= 0:
        sliding = _self_plan(*args, sliding_window_left, dec_first_col, q_lens_cpu, extent_cpu)
    cross = None
    if batch.encoder_lens is not None:
        enc_cpu = batch.encoder_lens_cpu.to(torch.int32)
        zeros = torch.zeros_like(enc_cpu)
        cross = paged_layout(
            req_to_token, batch.req_pool_indices, zeros.to(device), zeros, enc_cpu, page_size
        )
    return FlashInferMetadata(
        forward_mode=batch.forward_mode,
        batch_size=batch.batch_size,
        page_size=page_size,
        qo_indptr=cumulative(q_lens),
        q_lens_cpu=q_lens_cpu,
        is_decode=batch.forward_mode is ForwardMode.DECODE,
        full=full,
        sliding=sliding,
        cross=cross,
    )


def layout_tensors(layout: PagedLayout) -> dict[str, torch.Tensor]:
    """The layout's tensors by field name (static-buffer copies, equality checks)."""
    return {f.name: getattr(layout, f.name) for f in fields(layout)}


def _copy_prefix(buf: torch.Tensor, src: torch.Tensor, what: str) -> torch.Tensor:
    """Copy src into the front of buf and return that view of buf."""
    n = src.numel()
    if n > buf.numel():
        raise ValueError(f"{what}: {n} entries exceed its static buffer of {buf.numel()}")
    view = buf[:n]
    view.copy_(src.reshape(-1))
    return view


class _LayoutBuffers:
    """Static home of one PagedLayout: max_bs requests of up to max_pages pages each."""

    def __init__(self, max_bs: int, max_pages: int, device: torch.device | str) -> None:
        def z(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        self.indptr = z(max_bs + 1)
        self.indices = z(max_bs * max_pages)
        self.last_page_len = z(max_bs)
        self.kv_lens = z(max_bs)
        self.kv_start = z(max_bs)

    def load(self, layout: PagedLayout, what: str) -> PagedLayout:
        views = {
            name: _copy_prefix(getattr(self, name), src, f"{what}.{name}")
            for name, src in layout_tensors(layout).items()
        }
        return PagedLayout(**views)


class FlashInferStaticBuffers:
    """Fixed-address homes of every FlashInfer metadata tensor, for CUDA-graph capture and replay.

    `load(meta)` copies a freshly computed FlashInferMetadata (the eager computation of the padded
    batch) into the buffers and returns the same metadata on them; graph-mode wrappers are built
    over these buffers, so planning them with the returned views writes nothing new.
    """

    def __init__(
        self, max_bs: int, max_pages: int, max_tokens: int, max_context: int, device: torch.device | str
    ) -> None:
        self.max_bs = max_bs
        self.max_tokens = max_tokens
        self.qo_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.layouts = {
            name: _LayoutBuffers(max_bs, max_pages, device) for name in ("full", "sliding", "cross")
        }
        self.masks = {
            name: torch.zeros(max_tokens * max_context, dtype=torch.bool, device=device)
            for name in ("full", "sliding")
        }
        # Homes only graph-mode wrappers use (they copy into them when planned): the ragged call's
        # kv_indptr, and the custom mask packed to bits with its per-request byte offsets.
        self.ragged_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.packed_mask = torch.zeros(
            max_tokens * max_context // 8 + max_bs + 1, dtype=torch.uint8, device=device
        )
        self.mask_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)

    def _load_set(self, plan: WrapperSetPlan | None, name: str) -> WrapperSetPlan | None:
        if plan is None:
            return None
        paged = None if plan.paged is None else self.layouts[name].load(plan.paged, name)
        mask = (
            None
            if plan.custom_mask is None
            else _copy_prefix(self.masks[name], plan.custom_mask, f"{name}.mask")
        )
        return WrapperSetPlan(plan.window_left, paged, mask)

    def load(self, meta: FlashInferMetadata) -> FlashInferMetadata:
        if meta.batch_size > self.max_bs:
            raise ValueError(f"batch of {meta.batch_size} > static buffers for {self.max_bs}")
        return replace(
            meta,
            qo_indptr=_copy_prefix(self.qo_indptr, meta.qo_indptr, "qo_indptr"),
            full=self._load_set(meta.full, "full"),
            sliding=self._load_set(meta.sliding, "sliding"),
            cross=None if meta.cross is None else self.layouts["cross"].load(meta.cross, "cross"),
        )
