"""The attention backend interface of the paged-KV runtime.

Tensor layout (every backend): q [num_tokens, num_q_heads, head_dim]; k, v [num_tokens, num_kv_heads,
head_dim] (this step's new tokens, packed in batch order, request i owning query_lens[i] tokens);
the output is [num_tokens, num_q_heads, head_dim] in q's dtype.

Calling protocol, once per step: the runner builds a ForwardBatch, calls `init_forward_metadata(batch)`
(all per-batch metadata is computed there, once), then the model calls `forward(q, k, v, layer, batch)`
for every attention layer, passing that layer's own AttentionLayer (window, softcap, scale, kind).

Self-attention layers: with save_kv_cache, k/v are written to `batch.out_cache_loc` of buffer
`layer.layer_id` first; request i then attends causally (bottom-right aligned) to its decoder KV
`[0, kv_extent[i])` (batch.kv_extent_cpu(): seq_lens, or seq_lens + extend_seq_lens in
DRAFT_EXTEND_V2), limited to the last `layer.sliding_window` keys (query included) on window layers.
Cross-attention layers: k and v are None in every mode; request i attends, non-causally and without
a window, to its encoder slots `req_to_token[req_i, :encoder_lens[i]]` of buffer `layer.layer_id`,
which the model wrote once when the request's encoder ran (`save_kv`). Decoder layer i's self- and
cross-attention share buffer i (encoder slots vs decoder slots of the same request row).
"""

from __future__ import annotations

import abc

import torch

from mmgen.errors import MmgenError
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.forward_batch import ForwardBatch, ForwardMode
from mmgen.llm.memory import KVPool, ReqToTokenPool


class AttentionBackend(abc.ABC):
    """Computes attention for one step's batch over the paged KV pools it was built with."""

    name: str = "abstract"
    supports_cuda_graph: bool = False

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool):
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.page_size = kv_pool.page_size

    def cuda_graph_blocker(self) -> str | None:
        """Why this backend, as configured, cannot be captured in a CUDA graph (None: it can)."""
        if not self.supports_cuda_graph:
            return f"the {self.name} attention backend cannot run in CUDA graphs"
        return None

    @property
    def req_to_token(self) -> torch.Tensor:
        """int32 [max_reqs, max_context] column -> KV slot."""
        return self.req_to_token_pool.req_to_token

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Compute and store everything the layers of this step need; called once per step."""

    @abc.abstractmethod
    def init_cuda_graph_state(self, max_bs: int, max_tokens: int) -> None:
        """Allocate the static metadata buffers for graphs of up to max_bs requests / max_tokens tokens."""

    @abc.abstractmethod
    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Point the metadata at the static buffers for a capture of batch (its batch_size = the bucket)."""

    @abc.abstractmethod
    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Before a replay: compute the metadata of the padded batch with the same code as
        init_forward_metadata and copy it into the static buffers of its bucket."""

    # The two mode hooks take forward()'s arguments, typed and described there once; forward() is what
    # callers use. One hook per mode so that a backend can give decode its own kernel.
    @abc.abstractmethod
    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True) -> torch.Tensor:
        """EXTEND / MIXED / TARGET_VERIFY / DRAFT_EXTEND_V2: q [T, Hq, D] -> [T, Hq, D]."""

    @abc.abstractmethod
    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True) -> torch.Tensor:
        """DECODE: one query per request, q [B, Hq, D] -> [B, Hq, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: AttentionLayer,
        batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Dispatch on batch.forward_mode: q [T, Hq, D], k/v [T, Hk, D] or None (cross) -> [T, Hq, D]."""
        if layer.is_cross_attention and (k is not None or v is not None):
            raise MmgenError(
                f"layer {layer.layer_id}: cross-attention reads K/V from the encoder slots; "
                "write them with save_kv() when the encoder runs and pass k=v=None"
            )
        if not layer.is_cross_attention and save_kv_cache and (k is None or v is None):
            raise MmgenError(f"layer {layer.layer_id}: self-attention with save_kv_cache needs k and v")
        if batch.forward_mode is ForwardMode.IDLE:
            return q.new_empty((0, layer.num_q_heads, layer.head_dim))
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, batch, save_kv_cache)

    def save_kv(self, layer: AttentionLayer, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k/v [n, Hk, D] into slots loc [n] of buffer layer.layer_id (self: new tokens; cross: encoder)."""
        self.kv_pool.set_kv(layer.layer_id, loc, k, v)
