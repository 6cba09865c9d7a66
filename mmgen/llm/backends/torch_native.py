"""torch_native backend: dense per-request attention in torch, reading K/V through `req_to_token`.

The reference every other backend is tested against, and the CPU default. It handles every mode
with one path: request i's queries are its query_lens[i] newest tokens, its keys are the first
kv_extent[i] decoder slots of its row (causal, bottom-right aligned, optional sliding window) or,
for cross-attention, its encoder_lens[i] encoder slots. Math in fp32 via `attend_one`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mmgen.errors import MmgenError
from mmgen.kernels.flash_attn import attend_one
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.backends.layout import decoder_token_table, encoder_token_table
from mmgen.llm.forward_batch import ForwardBatch


@dataclass(frozen=True)
class TorchNativeMetadata:
    """Per-request host facts and slot lists of one step (computed once in init_forward_metadata)."""

    query_starts: tuple[int, ...]
    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    encoder_lens: tuple[int, ...]
    decoder_slots: tuple[torch.Tensor, ...]  # int64 [kv_lens[i]] per request
    encoder_slots: tuple[torch.Tensor, ...]  # int64 [encoder_lens[i]] per request


def build_torch_native_metadata(req_to_token: torch.Tensor, batch: ForwardBatch) -> TorchNativeMetadata:
    """Slot lists of every request of batch, validated against the batch's own lengths."""
    query_lens = [int(n) for n in batch.query_lens_cpu().tolist()]
    kv_lens = [int(n) for n in batch.kv_extent_cpu().tolist()]
    if batch.encoder_lens_cpu is not None:
        encoder_lens = [int(n) for n in batch.encoder_lens_cpu.tolist()]
    else:
        encoder_lens = [0] * batch.batch_size
    if sum(query_lens) != batch.num_tokens:
        raise MmgenError(
            f"batch has {batch.num_tokens} tokens but its query lengths sum to {sum(query_lens)}"
        )
    for i, (ql, kl) in enumerate(zip(query_lens, kv_lens, strict=True)):
        if ql > kl:
            raise MmgenError(f"request {i}: {ql} query tokens but a decoder KV extent of only {kl}")
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    enc_tensor = torch.tensor(encoder_lens, dtype=torch.int32, device=req_to_token.device)
    width = max(kv_lens, default=0)
    dec_table = decoder_token_table(req_to_token, batch.req_pool_indices, enc_tensor, max(width, 1)).long()
    enc_table = encoder_token_table(
        req_to_token, batch.req_pool_indices, max(max(encoder_lens, default=0), 1)
    )
    return TorchNativeMetadata(
        query_starts=tuple(starts),
        query_lens=tuple(query_lens),
        kv_lens=tuple(kv_lens),
        encoder_lens=tuple(encoder_lens),
        decoder_slots=tuple(dec_table[i, :n] for i, n in enumerate(kv_lens)),
        encoder_slots=tuple(enc_table[i, :n].long() for i, n in enumerate(encoder_lens)),
    )


EAGER_ONLY = "the torch_native attention backend runs eagerly only; use flash_attention or flashinfer"


class TorchNativeBackend(AttentionBackend):
    """Dense attention per request; eager only (host loops cannot be captured in a CUDA graph)."""

    name = "torch_native"
    supports_cuda_graph = False

    def __init__(self, req_to_token_pool, kv_pool):
        super().__init__(req_to_token_pool, kv_pool)
        self.metadata: TorchNativeMetadata | None = None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.metadata = build_torch_native_metadata(self.req_to_token, batch)

    def init_cuda_graph_state(self, max_bs: int, max_tokens: int) -> None:
        raise MmgenError(EAGER_ONLY)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        raise MmgenError(EAGER_ONLY)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        raise MmgenError(EAGER_ONLY)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        return self._attend(q, k, v, layer, batch, save_kv_cache)

    def _attend(
        self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool
    ) -> torch.Tensor:
        """q [T, Hq, D] (+ k/v [T, Hk, D] for self layers) -> [T, Hq, D] in q's dtype."""
        md = self.metadata
        if md is None:
            raise MmgenError("torch_native: init_forward_metadata(batch) must run before forward")
        if not layer.is_cross_attention and save_kv_cache:
            self.save_kv(layer, batch.out_cache_loc, k, v)
        k_buf = self.kv_pool.k_buffers[layer.layer_id]
        v_buf = self.kv_pool.v_buffers[layer.layer_id]
        window_left = None
        if layer.sliding_window is not None and not layer.is_cross_attention:
            # HF's causal sliding mask keeps keys j > i - window: `window` keys, the query's own included.
            window_left = layer.sliding_window - 1
        out = torch.empty(q.shape[0], layer.num_q_heads, layer.head_dim, dtype=q.dtype, device=q.device)
        for i, (start, qlen) in enumerate(zip(md.query_starts, md.query_lens, strict=True)):
            if qlen == 0:
                continue
            slots = md.encoder_slots[i] if layer.is_cross_attention else md.decoder_slots[i]
            if slots.numel() == 0:
                raise MmgenError(f"layer {layer.layer_id}: request {i} has no keys to attend to")
            o, _ = attend_one(
                q[start : start + qlen],
                k_buf[slots],
                v_buf[slots],
                scale=layer.scaling,
                causal=not layer.is_cross_attention,
                window_left=window_left,
                softcap=layer.logit_softcap,
            )
            out[start : start + qlen] = o.to(q.dtype)
        return out
