"""FlashAttention (FA3 `flash_attn_with_kvcache` / FA4 paged `flash_attn_varlen_func`) metadata.

One pure computation, `compute_flash_metadata(batch, req_to_token, page_size)`, used by eager runs
and by CUDA-graph replay alike: replay runs the same function and copies its result into static
buffers (`FlashStaticBuffers.load`), so the two cannot drift apart.

Conventions (DESIGN.md, forward_batch.py):
- The decoder KV extent of request i is `seq_lens[i]`, except in DRAFT_EXTEND_V2 where it is
  `seq_lens[i] + extend_seq_lens[i]` (seq_lens is the prefix there); max_seq_len_k is the max of the
  per-request extents, never max(prefix) + max(extend).
- Row i of req_to_token holds encoder slots in columns [0, encoder_lens[i]) and decoder slots from
  column encoder_lens[i] on, each part starting on a fresh page. Page tables are per-row gathers.
- Scheduler metadata (FA3's `get_scheduler_metadata`) depends on the call's window and kind (self
  or cross), so it is computed once per batch for each distinct `AttentionSite`, never per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace

import torch

from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class AttentionSite:
    """What a kernel call's schedule depends on besides the batch (layers with equal sites share one).

    is_cross: keys are the encoder's (non-causal); window_left: -1 = none; the head layout; softcap.
    """

    is_cross: bool
    window_left: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    has_softcap: bool


def site_of(layer: AttentionLayer) -> AttentionSite:
    """The schedule key of a layer; cross-attention never has a window."""
    return AttentionSite(
        is_cross=layer.is_cross_attention,
        window_left=window_left_of(layer),
        num_q_heads=layer.num_q_heads,
        num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim,
        has_softcap=layer.logit_softcap > 0,
    )


def window_left_of(layer: AttentionLayer) -> int:
    """flash-attn/FlashInfer window_left: keys before the query it may see (-1 = unbounded)."""
    if layer.is_cross_attention or layer.sliding_window is None:
        return -1
    return layer.sliding_window - 1


def distinct_sites(layers: Iterable[AttentionLayer]) -> tuple[AttentionSite, ...]:
    """Distinct sites in first-seen order (a stable order keeps eager and replay schedules aligned)."""
    seen: dict[AttentionSite, None] = {}
    for layer in layers:
        seen.setdefault(site_of(layer), None)
    return tuple(seen)


def ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return (a + (b - 1)) // b


def page_table_rows(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    first_col: torch.Tensor,
    num_tokens: torch.Tensor,
    page_size: int,
    width: int,
) -> torch.Tensor:
    """Page ids of columns [first_col[i], first_col[i] + num_tokens[i]) of each row -> int32 [B, width].

    req_to_token int32 [R, C]; rows int64 [B]; first_col/num_tokens int32 [B] (first_col on a page
    boundary of the row). Entries past a row's last page are 0 (the scratch page), so the table is
    a deterministic function of the batch and kernels never see garbage indices.
    """
    device = req_to_token.device
    pages = torch.arange(width, dtype=torch.int64, device=device)
    valid = pages[None, :] < ceil_div(num_tokens.long(), page_size)[:, None]
    cols = first_col.long()[:, None] + pages[None, :] * page_size
    cols = torch.where(valid, cols, torch.zeros_like(cols))
    slots = req_to_token[rows.long()[:, None], cols]
    return torch.where(valid, slots // page_size, torch.zeros_like(slots)).to(torch.int32)


def cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """[B] lengths -> int32 [B + 1] offsets starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths.to(torch.int32), dim=0)
    return out


def query_lens(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """New query tokens per request, (device int32 [B], host int32 [B]) (ForwardBatch.query_lens_cpu)."""
    host = batch.query_lens_cpu().to(torch.int32)
    extend_like = batch.forward_mode.is_extend_like() and batch.extend_seq_lens is not None
    dev = batch.extend_seq_lens.to(torch.int32) if extend_like else host.to(batch.seq_lens.device)
    return dev, host


def kv_extent(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder KV length the kernels read per request, (device int32 [B], host int32 [B])."""
    if batch.forward_mode is ForwardMode.DRAFT_EXTEND_V2:
        assert batch.extend_seq_lens is not None
        dev = batch.seq_lens.to(torch.int32) + batch.extend_seq_lens.to(torch.int32)
    else:
        dev = batch.seq_lens.to(torch.int32)
    return dev, batch.kv_extent_cpu().to(torch.int32)


def _max(x: torch.Tensor) -> int:
    return int(x.max()) if x.numel() else 0


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """Everything a FlashAttention call of one step needs, shared by every layer of the step.

    cache_seqlens_int32 [B]: decoder KV extent per request (seqused_k / cache_seqlens).
    cu_seqlens_q [B + 1], cu_seqlens_k [B + 1]: int32 offsets of queries and of decoder keys.
    page_table int32 [B, pages]: decoder pages of row i, gathered from column encoder_lens[i] on.
    encoder_*: the same for cross-attention (None for decoder-only batches).
    scheduler_metadata: ((site, schedule), ...) one entry per distinct site, computed once per batch.
    """

    forward_mode: ForwardMode
    batch_size: int
    page_size: int
    cache_seqlens_int32: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seq_len_q: int
    max_seq_len_k: int
    page_table: torch.Tensor
    encoder_lens_int32: torch.Tensor | None = None
    encoder_cu_seqlens_k: torch.Tensor | None = None
    encoder_max_seq_len_k: int = 0
    encoder_page_table: torch.Tensor | None = None
    scheduler_metadata: tuple[tuple[AttentionSite, object], ...] = ()

    def schedule_for(self, layer: AttentionLayer) -> object | None:
        """The scheduler metadata computed for this layer's site; None when no schedule was computed."""
        if not self.scheduler_metadata:
            return None
        site = site_of(layer)
        for key, schedule in self.scheduler_metadata:
            if key == site:
                return schedule
        known = [k for k, _ in self.scheduler_metadata]
        raise KeyError(f"no scheduler metadata for layer {layer.layer_id} site {site}; computed for {known}")


def compute_flash_metadata(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    page_table_width: int | None = None,
    encoder_page_table_width: int | None = None,
) -> FlashAttentionMetadata:
    """The one metadata computation of the FlashAttention backend (without scheduler metadata).

    page_table_width / encoder_page_table_width: widen the tables to a fixed number of pages (static
    CUDA-graph buffers); by default they are as wide as the longest request needs.
    """
    q_lens, q_lens_cpu = query_lens(batch)
    extent, extent_cpu = kv_extent(batch)
    need = int(ceil_div(extent_cpu, page_size).max()) if batch.batch_size else 0
    width = need if page_table_width is None else page_table_width
    if width < need:
        raise ValueError(f"page table width {width} < {need} pages the batch reads")
    if batch.encoder_lens is not None:
        assert batch.encoder_lens_cpu is not None
        enc = batch.encoder_lens.to(torch.int32)
        enc_cpu = batch.encoder_lens_cpu.to(torch.int32)
        dec_first_col = enc
    else:
        enc = enc_cpu = None
        dec_first_col = torch.zeros_like(extent)
    page_table = page_table_rows(
        req_to_token, batch.req_pool_indices, dec_first_col, extent, page_size, width
    )
    meta = FlashAttentionMetadata(
        forward_mode=batch.forward_mode,
        batch_size=batch.batch_size,
        page_size=page_size,
        cache_seqlens_int32=extent,
        cu_seqlens_q=cumulative(q_lens),
        cu_seqlens_k=cumulative(extent),
        max_seq_len_q=_max(q_lens_cpu),
        max_seq_len_k=_max(extent_cpu),
        page_table=page_table,
    )
    if enc is None:
        return meta
    enc_need = int(ceil_div(enc_cpu, page_size).max()) if batch.batch_size else 0
    enc_width = enc_need if encoder_page_table_width is None else encoder_page_table_width
    if enc_width < enc_need:
        raise ValueError(f"encoder page table width {enc_width} < {enc_need} pages the batch reads")
    enc_table = page_table_rows(
        req_to_token, batch.req_pool_indices, torch.zeros_like(enc), enc, page_size, enc_width
    )
    return replace(
        meta,
        encoder_lens_int32=enc,
        encoder_cu_seqlens_k=cumulative(enc),
        encoder_max_seq_len_k=_max(enc_cpu),
        encoder_page_table=enc_table,
    )


SchedulerFn = Callable[..., object]


def schedule_one(
    meta: FlashAttentionMetadata, site: AttentionSite, dtype: torch.dtype, get_scheduler_metadata: SchedulerFn
) -> object:
    """`get_scheduler_metadata` (FA3 signature) for one site of this batch: exactly the arguments the
    backend's kernel call will carry (cache lengths, cu_seqlens_q, page size, window, softcap)."""
    if site.is_cross:
        assert meta.encoder_lens_int32 is not None, "cross-attention site in a decoder-only batch"
        seqlens, max_k, causal = meta.encoder_lens_int32, meta.encoder_max_seq_len_k, False
    else:
        seqlens, max_k, causal = meta.cache_seqlens_int32, meta.max_seq_len_k, True
    return get_scheduler_metadata(
        meta.batch_size,
        meta.max_seq_len_q,
        max_k,
        site.num_q_heads,
        site.num_kv_heads,
        site.head_dim,
        seqlens,
        qkv_dtype=dtype,
        cu_seqlens_q=meta.cu_seqlens_q,
        page_size=meta.page_size,
        causal=causal,
        window_size=kernel_window(site.window_left, causal),
        has_softcap=site.has_softcap,
    )


def kernel_window(window_left: int, causal: bool) -> tuple[int, int]:
    """flash-attn window_size for a call: (-1, -1) unbounded; a causal window keeps right = 0."""
    if window_left < 0:
        return (-1, -1)
    return (window_left, 0 if causal else -1)


def compute_scheduler_metadata(
    meta: FlashAttentionMetadata,
    sites: tuple[AttentionSite, ...],
    dtype: torch.dtype,
    get_scheduler_metadata: SchedulerFn,
) -> tuple[tuple[AttentionSite, object], ...]:
    """One `get_scheduler_metadata` call per distinct site, once per batch; layers look theirs up."""
    return tuple((site, schedule_one(meta, site, dtype, get_scheduler_metadata)) for site in sites)


_TENSOR_FIELDS = (
    "cache_seqlens_int32",
    "cu_seqlens_q",
    "cu_seqlens_k",
    "page_table",
    "encoder_lens_int32",
    "encoder_cu_seqlens_k",
    "encoder_page_table",
)


def metadata_tensors(meta: FlashAttentionMetadata) -> dict[str, torch.Tensor | None]:
    """The tensor fields by name (used by static-buffer copies and by equality checks)."""
    return {f.name: getattr(meta, f.name) for f in fields(meta) if f.name in _TENSOR_FIELDS}


class FlashStaticBuffers:
    """Fixed-address tensors a captured CUDA graph reads; replay copies freshly computed metadata in.

    Sized for max_bs requests and page tables of max_pages / max_encoder_pages columns. Rows past the
    live batch and columns past the live width are zeroed on each load, so what the graph reads is
    exactly `compute_flash_metadata` of the (padded) batch.
    """

    def __init__(
        self, max_bs: int, max_pages: int, max_encoder_pages: int, device: torch.device | str
    ) -> None:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=device)

        self.max_bs = max_bs
        self.max_pages = max_pages
        self.max_encoder_pages = max_encoder_pages
        self.cache_seqlens_int32 = z(max_bs)
        self.cu_seqlens_q = z(max_bs + 1)
        self.cu_seqlens_k = z(max_bs + 1)
        self.page_table = z(max_bs, max_pages)
        self.encoder_lens_int32 = z(max_bs)
        self.encoder_cu_seqlens_k = z(max_bs + 1)
        self.encoder_page_table = z(max_bs, max_encoder_pages)
        self.schedules: dict[tuple[int, AttentionSite], object] = {}

    def load(self, meta: FlashAttentionMetadata) -> FlashAttentionMetadata:
        """Copy `meta` (computed for a batch of bs <= max_bs) into the buffers; return it on them.

        Every one of the bs rows is copied, encoder lengths included (a copy of row 0 only would
        leave the other requests with stale lengths from the capture batch).
        """
        bs = meta.batch_size
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} > static buffers for {self.max_bs}")
        views: dict[str, torch.Tensor | None] = {}
        for name, src in metadata_tensors(meta).items():
            if src is None:
                views[name] = None
                continue
            buf: torch.Tensor = getattr(self, name)
            rows = bs + 1 if name.startswith("cu_") or name == "encoder_cu_seqlens_k" else bs
            view = buf[:rows]
            if src.dim() == 2:
                if src.shape[1] > buf.shape[1]:
                    raise ValueError(f"{name}: {src.shape[1]} pages > static width {buf.shape[1]}")
                view[:, src.shape[1] :].zero_()
                view[:, : src.shape[1]].copy_(src)
            else:
                view.copy_(src)
            views[name] = view
        schedules = []
        for site, schedule in meta.scheduler_metadata:
            key = (bs, site)
            held = self.schedules.get(key)
            if isinstance(held, torch.Tensor) and isinstance(schedule, torch.Tensor):
                if held.shape != schedule.shape:
                    raise ValueError(
                        f"scheduler metadata for {site} changed shape {list(held.shape)} -> "
                        f"{list(schedule.shape)} between capture and replay of batch size {bs}"
                    )
                held.copy_(schedule)
            else:
                held = schedule.clone() if isinstance(schedule, torch.Tensor) else schedule
                self.schedules[key] = held
            schedules.append((site, held))
        return replace(meta, scheduler_metadata=tuple(schedules), **views)
