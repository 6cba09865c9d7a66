"""FlashAttention (FA3 `flash_attn_with_kvcache` / FA4 paged `flash_attn_varlen_func`) metadata.

One pure computation, `compute_flash_metadata(batch, req_to_token, page_size)`, used by eager runs
and by CUDA-graph replay alike: replay runs the same function and copies its result into static
buffers (`FlashStaticBuffers.load`), so the two cannot drift apart. Host work per step: a few
vectorized ops on the batch's host lengths, one non-blocking upload, a gather and a scatter on the
device (layout.py), no device->host read.

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
from dataclasses import dataclass, replace

import torch

from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.layout import padded_page_ids, upload
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


@dataclass(frozen=True)
class FlashAttentionMetadata:
    """Everything a FlashAttention call of one step needs, shared by every layer of the step.

    cache_seqlens_int32 [B]: decoder KV extent per request (seqused_k / cache_seqlens).
    cu_seqlens_q [B + 1], cu_seqlens_k [B + 1]: int32 offsets of queries and of decoder keys.
    page_table int32 [B, pages]: decoder pages of row i, gathered from column encoder_lens[i] on.
    encoder_*: the same for cross-attention (None for decoder-only batches; same table width).
    scheduler_metadata: ((site, schedule), ...) one entry per distinct site, computed once per batch.
    lengths int32 [5, B + 1] and tables int32 [B or 2B, pages]: the two device tensors the fields
    above are views of (rows of lengths: cu_seqlens_q, cu_seqlens_k, encoder_cu_seqlens_k, then
    cache_seqlens and encoder_lens in the first B columns; rows of tables: the decoder table, then
    the encoder table), so a CUDA-graph replay loads a whole step's metadata with two copies.
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
    lengths: torch.Tensor
    tables: torch.Tensor
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


def _views(lengths: torch.Tensor, tables: torch.Tensor, b: int, has_encoder: bool) -> dict:
    """The named metadata fields as views of the two backing tensors."""
    return dict(
        cu_seqlens_q=lengths[0],
        cu_seqlens_k=lengths[1],
        cache_seqlens_int32=lengths[3, :b],
        page_table=tables[:b],
        lengths=lengths,
        tables=tables,
        encoder_cu_seqlens_k=lengths[2] if has_encoder else None,
        encoder_lens_int32=lengths[4, :b] if has_encoder else None,
        encoder_page_table=tables[b : 2 * b] if has_encoder else None,
    )


def compute_flash_metadata(
    batch: ForwardBatch,
    req_to_token: torch.Tensor,
    page_size: int,
    page_table_width: int | None = None,
) -> FlashAttentionMetadata:
    """The one metadata computation of the FlashAttention backend (without scheduler metadata).

    The host works only on per-request numbers from the batch's host lengths; one non-blocking copy
    sends them to the device, where a few ops gather both page tables from req_to_token (entries past
    a row's last page are 0, the scratch page, so the tables are a deterministic function of the
    batch). No value is read back from the device.
    page_table_width: a fixed number of columns for both tables (static CUDA-graph buffers); by
    default as many as the longest decoder or encoder part of the batch needs.
    """
    b = batch.batch_size
    has_encoder = batch.encoder_lens is not None
    if has_encoder:
        assert batch.encoder_lens_cpu is not None
        enc = batch.encoder_lens_cpu
    else:
        enc = torch.zeros(b, dtype=torch.int32)
    # per_request rows: query tokens, decoder KV extent, encoder length (host int32 [3, B]).
    per_request = torch.stack([batch.query_lens_cpu(), batch.kv_extent_cpu(), enc]).to(torch.int32)
    max_q, max_k, max_enc = per_request.max(dim=1).values.tolist() if b else (0, 0, 0)
    need = -(-max(max_k, max_enc) // page_size)
    width = need if page_table_width is None else page_table_width
    if width < need:
        raise ValueError(f"page table width {width} < {need} pages the batch reads")
    # lengths rows: cu_seqlens_q, cu_seqlens_k, encoder_cu_seqlens_k, cache_seqlens, encoder_lens.
    lengths = torch.zeros(5, b + 1, dtype=torch.int32)
    torch.cumsum(per_request, dim=1, out=lengths[:3, 1:])
    lengths[3:, :b] = per_request[1:]
    # One run per table row (request, first column, tokens): row i's decoder part, which starts at
    # its own column encoder_lens[i], then (with an encoder) its encoder part, from column 0.
    runs = torch.zeros(3, 2 if has_encoder else 1, b, dtype=torch.int32)
    runs[0] = torch.arange(b, dtype=torch.int32)
    runs[1, 0] = per_request[2]
    runs[2] = per_request[1 : 1 + runs.shape[1]]
    dev_lengths, dev_runs = upload([lengths, runs.view(3, -1)], req_to_token.device)
    tables = padded_page_ids(req_to_token, batch.req_pool_indices, *dev_runs, width, page_size)
    return FlashAttentionMetadata(
        forward_mode=batch.forward_mode,
        batch_size=b,
        page_size=page_size,
        max_seq_len_q=max_q,
        max_seq_len_k=max_k,
        encoder_max_seq_len_k=max_enc if has_encoder else 0,
        **_views(dev_lengths, tables, b, has_encoder),
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
    """The named tensor fields (used by equality checks)."""
    return {name: getattr(meta, name) for name in _TENSOR_FIELDS}


class FlashStaticBuffers:
    """Fixed-address tensors a captured CUDA graph reads; replay copies freshly computed metadata in.

    lengths int32 [5, max_bs + 1] and tables int32 [2 * max_bs, max_pages] hold a batch of
    bs <= max_bs requests laid out as FlashAttentionMetadata's backing tensors (tables computed at
    the static width), so `load` is two device copies whatever the batch.
    """

    def __init__(self, max_bs: int, max_pages: int, device: torch.device | str) -> None:
        self.max_bs = max_bs
        self.max_pages = max_pages
        self.lengths = torch.zeros(5, max_bs + 1, dtype=torch.int32, device=device)
        self.tables = torch.zeros(2 * max_bs, max_pages, dtype=torch.int32, device=device)
        self.schedules: dict[tuple[int, AttentionSite], object] = {}

    def load(self, meta: FlashAttentionMetadata) -> FlashAttentionMetadata:
        """Copy `meta` (computed at the static width for bs <= max_bs requests) in; return it on the buffers.

        All bs + 1 columns of lengths are copied: every request's encoder length, not just row 0's.
        """
        bs = meta.batch_size
        if bs > self.max_bs:
            raise ValueError(f"batch of {bs} > static buffers for {self.max_bs}")
        if meta.tables.shape[1] != self.max_pages:
            raise ValueError(
                f"page tables of {meta.tables.shape[1]} columns; the static ones have {self.max_pages}"
            )
        lengths = self.lengths[:, : bs + 1]
        lengths.copy_(meta.lengths)
        tables = self.tables[: meta.tables.shape[0]]
        tables.copy_(meta.tables)
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
        views = _views(lengths, tables, bs, meta.encoder_page_table is not None)
        return replace(meta, scheduler_metadata=tuple(schedules), **views)
