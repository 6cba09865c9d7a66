"""flash_attention backend: FA3 `flash_attn_with_kvcache`, or FA4's paged varlen kernel, over the paged KV.

Kernels come from a provider (`mmgen.kernels.load_flash_attention_provider`): FA3 where installed, else
FA4 on Hopper/Blackwell, else the pure-torch references (CPU). Every call has the FA3 kvcache shape:
packed queries by cu_seqlens_q, the layer's paged K/V cache, cache_seqlens = each request's KV extent,
and a page table. Self-attention reads the decoder pages (from column encoder_lens[i] of row i),
causal and bottom-right aligned, with the layer's window; cross-attention reads the encoder pages of
each request, non-causal.

Metadata is computed once per step by `compute_flash_metadata` (flash_metadata.py), scheduler
metadata once per distinct AttentionSite; CUDA-graph capture/replay run that same function and copy
its result into FlashStaticBuffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from mmgen.errors import MmgenError
from mmgen.kernels.fa_providers import load_flash_attention_provider
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.backends.flash_metadata import (
    FlashAttentionMetadata,
    FlashStaticBuffers,
    compute_flash_metadata,
    compute_scheduler_metadata,
    distinct_sites,
    kernel_window,
    window_left_of,
)
from mmgen.llm.forward_batch import ForwardBatch
from mmgen.llm.memory import KVPool, ReqToTokenPool


class FlashAttentionBackend(AttentionBackend):
    """Paged attention through a FlashAttention provider; CUDA-graph capable.

    layers: every attention site of the model (e.g. model.decoder_attention_layers()); scheduler
    metadata is computed for each distinct site once per batch.
    """

    name = "flash_attention"
    supports_cuda_graph = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        layers: Sequence[AttentionLayer] = (),
        provider: object | None = None,
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        if provider is None:
            windows = any(window_left_of(layer) >= 0 for layer in layers)
            provider = load_flash_attention_provider(
                "auto", paged_kv=True, window=windows, device=self.req_to_token.device, dtype=kv_pool.dtype
            )
        self.provider = provider
        self.sites = distinct_sites(layers)
        self.metadata: FlashAttentionMetadata | None = None
        self.static: FlashStaticBuffers | None = None

    def cuda_graph_blocker(self) -> str | None:
        if getattr(self.provider, "name", None) == "reference":
            return (
                "flash_attention: the reference provider cannot be captured in a CUDA graph (it reads "
                "lengths back to the host); install flash-attn-4 or fa3"
            )
        return super().cuda_graph_blocker()

    # -- metadata ---------------------------------------------------------------------------------

    def _compute(self, batch: ForwardBatch, static: bool) -> FlashAttentionMetadata:
        """The one computation: metadata of `batch`, plus its scheduler metadata (once per distinct site)."""
        width = None
        if static:
            assert self.static is not None
            width = self.static.max_pages
        meta = compute_flash_metadata(batch, self.req_to_token, self.page_size, page_table_width=width)
        if self.sites and batch.batch_size:
            sites = (
                self.sites
                if meta.encoder_lens_int32 is not None
                else tuple(s for s in self.sites if not s.is_cross)
            )
            schedules = compute_scheduler_metadata(
                meta, sites, self.kv_pool.dtype, self.provider.get_scheduler_metadata
            )
            meta = replace(meta, scheduler_metadata=schedules)
        return meta

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.metadata = self._compute(batch, static=False)

    def init_cuda_graph_state(self, max_bs: int, max_tokens: int) -> None:
        pages = -(-self.req_to_token.shape[1] // self.page_size)
        self.static = FlashStaticBuffers(max_bs, pages, self.req_to_token.device)

    def _require_static(self) -> FlashStaticBuffers:
        if self.static is None:
            raise MmgenError(
                "flash_attention: init_cuda_graph_state(max_bs, max_tokens) must run before capture"
            )
        return self.static

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        static = self._require_static()
        meta = static.load(self._compute(batch, static=True))
        # Host ints are baked into the captured kernels: capture with the largest extent the static
        # page tables allow, so every later replay of this bucket stays within them.
        bound = static.max_pages * self.page_size
        self.metadata = replace(meta, max_seq_len_k=bound, encoder_max_seq_len_k=bound)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.metadata = self._require_static().load(self._compute(batch, static=True))

    # -- attention --------------------------------------------------------------------------------

    def _attend(
        self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool
    ) -> torch.Tensor:
        """q [T, Hq, D] (+ k/v [T, Hk, D] for self layers) -> [T, Hq, D]."""
        md = self.metadata
        if md is None:
            raise MmgenError("flash_attention: init_forward_metadata(batch) must run before forward")
        if not layer.is_cross_attention and save_kv_cache:
            self.save_kv(layer, batch.out_cache_loc, k, v)
        if layer.is_cross_attention:
            if md.encoder_page_table is None:
                raise MmgenError(f"layer {layer.layer_id}: cross-attention in a batch without encoder_lens")
            seqlens, table, causal = md.encoder_lens_int32, md.encoder_page_table, False
        else:
            seqlens, table, causal = md.cache_seqlens_int32, md.page_table, True
        return self.provider.flash_attn_with_kvcache(
            q,
            self.kv_pool.k_pages(layer.layer_id),
            self.kv_pool.v_pages(layer.layer_id),
            cache_seqlens=seqlens,
            page_table=table,
            cu_seqlens_q=md.cu_seqlens_q,
            max_seqlen_q=md.max_seq_len_q,
            softmax_scale=layer.scaling,
            causal=causal,
            window_size=kernel_window(window_left_of(layer), causal),
            softcap=layer.logit_softcap,
            scheduler_metadata=md.schedule_for(layer),
        )

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)
