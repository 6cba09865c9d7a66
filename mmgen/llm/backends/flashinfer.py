"""flashinfer backend: FlashInfer's paged decode, ragged + paged prefill wrappers and merge_state.

Kernels come from a provider (`mmgen.kernels.load_flashinfer_provider`): the flashinfer package on
CUDA, else the pure-torch references with the same wrapper API (CPU). Wrapper sets, each planned once
per step from `compute_flashinfer_metadata` (flashinfer_metadata.py):
- "sliding": the sliding-window self-attention layers (window_left on every call, KV trimmed to the
  keys the window can reach, a custom mask on the paged prefix of extend steps);
- "full": the global self-attention layers; "cross": the cross-attention layers (encoder pages,
  non-causal). Global and cross layers together form the second wrapper set of DESIGN.md.
DECODE runs the decode wrapper. Extend-like modes run the ragged wrapper over the step's new tokens
(causal) and, when some request has a cached prefix, the paged wrapper over the prefix (non-causal),
then merge the two with their base-2 LSEs. Cross-attention in extend modes is one paged call.

CUDA graphs: per captured batch size, graph-mode wrappers over FlashInferStaticBuffers; replay
computes the metadata of the padded batch with the eager function and plans the bucket's wrappers
with it, which copies it into their static buffers (FlashInfer's CUDA-graph mode).

Plans take the host arrays (qo_indptr, page indptr, last_page_len) as host tensors: FlashInfer reads
them on the host, so a device tensor would cost a device->host sync per plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.errors import MmgenError, ValidationError
from mmgen.kernels.flashinfer_providers import load_flashinfer_provider
from mmgen.llm.attention_layer import AttentionLayer
from mmgen.llm.backends.base import AttentionBackend
from mmgen.llm.backends.flash_metadata import window_left_of
from mmgen.llm.backends.flashinfer_metadata import (
    FlashInferMetadata,
    FlashInferStaticBuffers,
    PagedLayout,
    WrapperSetPlan,
    compute_flashinfer_metadata,
)
from mmgen.llm.backends.layout import upload
from mmgen.llm.forward_batch import ForwardBatch
from mmgen.llm.memory import KVPool, ReqToTokenPool

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class SetSpec:
    """Plan arguments shared by every layer of one wrapper set."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    logit_softcap: float


def _set_name(layer: AttentionLayer) -> str:
    if layer.is_cross_attention:
        return "cross"
    return "sliding" if window_left_of(layer) >= 0 else "full"


def _set_specs(layers: Sequence[AttentionLayer]) -> tuple[dict[str, SetSpec], int | None]:
    """Each used set's plan arguments, and the sliding layers' window_left (one value: one wrapper set)."""
    specs: dict[str, SetSpec] = {}
    windows = set()
    for layer in layers:
        name = _set_name(layer)
        spec = SetSpec(
            layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.scaling, layer.logit_softcap
        )
        if specs.setdefault(name, spec) != spec:
            raise ValidationError(
                f"flashinfer: layer {layer.layer_id} ({name}) has {spec}, other {name} layers {specs[name]}; "
                "a wrapper set is planned once for all its layers"
            )
        if name == "sliding":
            windows.add(window_left_of(layer))
    if len(windows) > 1:
        raise ValidationError(
            f"flashinfer: sliding layers with different windows {sorted(windows)}; one is supported"
        )
    return specs, (windows.pop() if windows else None)


class _Wrappers:
    """The decode, ragged and paged wrappers of one set (eager, or graph-mode for one batch size)."""

    def __init__(self, decode=None, ragged=None, paged=None) -> None:
        self.decode = decode
        self.ragged = ragged
        self.paged = paged


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer wrappers; CUDA-graph capable.

    layers: every attention site of the model (e.g. model.decoder_attention_layers()): the sets'
    plan arguments and the sliding window come from them. use_tensor_cores: decode through the
    tensor-core (prefill) kernels. kernel_backend: FlashInfer's `backend=` for every wrapper ("auto",
    "fa2", "fa3"); one fixed value keeps the number of JIT-built modules down.
    """

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: KVPool,
        layers: Sequence[AttentionLayer] = (),
        provider: object | None = None,
        use_tensor_cores: bool = True,
        workspace_bytes: int = WORKSPACE_BYTES,
        kernel_backend: str = "auto",
    ) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        if not layers:
            raise ValidationError(
                "flashinfer backend needs the model's attention layers (layers=...) to plan"
            )
        if provider is None:
            provider = load_flashinfer_provider("auto", device=self.req_to_token.device, dtype=kv_pool.dtype)
        self.provider = provider
        self.specs, self.sliding_window_left = _set_specs(layers)
        self.use_tensor_cores = use_tensor_cores
        self.kernel_backend = kernel_backend
        device = self.req_to_token.device
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self.eager = {name: self._make_wrappers(name, None, 0) for name in self.specs}
        self.active = self.eager
        self.metadata: FlashInferMetadata | None = None
        self.static: FlashInferStaticBuffers | None = None
        self.graph_wrappers: dict[tuple[int, bool], dict[str, _Wrappers]] = {}
        self.graph_structure: dict[tuple[int, bool], tuple[bool, ...]] = {}

    def cuda_graph_blocker(self) -> str | None:
        if getattr(self.provider, "name", None) == "reference":
            return (
                "flashinfer: the reference provider cannot be captured in a CUDA graph (it reads "
                "its plans back to the host); install flashinfer-python"
            )
        return super().cuda_graph_blocker()

    # -- wrappers ---------------------------------------------------------------------------------

    def _make_wrappers(self, name: str, static: FlashInferStaticBuffers | None, bs: int) -> _Wrappers:
        """Eager wrappers (static None) or graph-mode ones over the static buffers for batch size bs."""
        p, ws, kb = self.provider, self.workspace, self.kernel_backend
        if static is None:
            decode = p.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=self.use_tensor_cores, backend=kb
            )
            ragged = (
                None if name == "cross" else p.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=kb)
            )
            return _Wrappers(decode, ragged, p.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=kb))
        lay = static.layouts[name]
        decode = p.BatchDecodeWithPagedKVCacheWrapper(
            ws,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            backend=kb,
            paged_kv_indptr_buffer=lay.indptr[: bs + 1],
            paged_kv_indices_buffer=lay.indices,
            paged_kv_last_page_len_buffer=lay.last_page_len[:bs],
        )
        qo = static.qo_indptr[: bs + 1]
        ragged = None
        if name != "cross":
            ragged = p.BatchPrefillWithRaggedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=qo,
                kv_indptr_buf=static.ragged_kv_indptr[: bs + 1],
                backend=kb,
            )
        mask = {}
        if name == "sliding":
            mask = dict(custom_mask_buf=static.packed_mask, mask_indptr_buf=static.mask_indptr[: bs + 1])
        paged = p.BatchPrefillWithPagedKVCacheWrapper(
            ws,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=qo,
            paged_kv_indptr_buf=lay.indptr[: bs + 1],
            paged_kv_indices_buf=lay.indices,
            paged_kv_last_page_len_buf=lay.last_page_len[:bs],
            backend=kb,
            **mask,
        )
        return _Wrappers(decode, ragged, paged)

    def _common(self, name: str) -> dict:
        spec = self.specs[name]
        dtype = self.kv_pool.dtype
        return dict(
            sm_scale=spec.scaling,
            logits_soft_cap=spec.logit_softcap or None,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def _heads(self, name: str, page_size: int | None = None) -> tuple[int, ...]:
        spec = self.specs[name]
        heads = (spec.num_q_heads, spec.num_kv_heads, spec.head_dim)
        return heads if page_size is None else (*heads, page_size)

    def _plan_paged(self, wrapper, meta: FlashInferMetadata, name: str, layout: PagedLayout, plan_args: dict):
        qo_indptr, indptr, last_page_len = meta.qo_indptr, layout.indptr, layout.last_page_len
        if plan_args.get("custom_mask") is not None:
            # plan() packs a custom mask on the device with offsets it derives from these three arrays,
            # so here they must be device tensors (plan then reads them back: one sync, only in extend
            # steps of sliding-window layers with a cached prefix).
            qo_indptr, indptr, last_page_len = upload(
                [qo_indptr, indptr, last_page_len], self.req_to_token.device
            )
        wrapper.plan(
            qo_indptr,
            indptr,
            layout.indices,
            last_page_len,
            *self._heads(name, meta.page_size),
            **plan_args,
            **self._common(name),
        )

    def _plan(self, meta: FlashInferMetadata, wrappers: dict[str, _Wrappers]) -> None:
        """Plan every used set's wrappers for this step (host work, once per step)."""
        for name in ("full", "sliding"):
            plan: WrapperSetPlan | None = getattr(meta, name)
            if name not in self.specs or plan is None:
                continue
            w = wrappers[name]
            if meta.is_decode:
                lay = plan.paged
                w.decode.plan(
                    lay.indptr,
                    lay.indices,
                    lay.last_page_len,
                    *self._heads(name, meta.page_size),
                    window_left=plan.window_left,
                    **self._common(name),
                )
                continue
            w.ragged.plan(
                meta.qo_indptr,
                meta.qo_indptr,
                *self._heads(name),
                causal=True,
                window_left=plan.window_left,
                **self._common(name),
            )
            if plan.paged is not None:
                args = dict(custom_mask=plan.custom_mask, causal=False, window_left=plan.window_left)
                self._plan_paged(w.paged, meta, name, plan.paged, args)
        if "cross" in self.specs and meta.cross is not None:
            w = wrappers["cross"]
            if meta.is_decode:
                lay = meta.cross
                w.decode.plan(
                    lay.indptr, lay.indices, lay.last_page_len, *self._heads("cross", meta.page_size),
                    window_left=-1, **self._common("cross"),
                )  # fmt: skip
            else:
                self._plan_paged(w.paged, meta, "cross", meta.cross, dict(causal=False, window_left=-1))

    # -- metadata ---------------------------------------------------------------------------------

    def _compute(self, batch: ForwardBatch) -> FlashInferMetadata:
        """The one computation of this backend's metadata (eager, capture and replay alike)."""
        return compute_flashinfer_metadata(batch, self.req_to_token, self.page_size, self.sliding_window_left)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        meta = self._compute(batch)
        if batch.batch_size:  # an IDLE step runs no kernel; FlashInfer need not plan an empty batch
            self._plan(meta, self.eager)
        self.metadata, self.active = meta, self.eager

    def init_cuda_graph_state(self, max_bs: int, max_tokens: int) -> None:
        context = self.req_to_token.shape[1]
        pages = -(-context // self.page_size)
        self.static = FlashInferStaticBuffers(max_bs, pages, max_tokens, context, self.req_to_token.device)

    def _structure(self, meta: FlashInferMetadata) -> tuple[bool, ...]:
        """Which calls a step makes: fixed by a capture, so replays must match it."""
        return tuple(p is not None and p.paged is not None for p in (meta.full, meta.sliding))

    def _graph_step(self, batch: ForwardBatch, capture: bool) -> None:
        if self.static is None:
            raise MmgenError("flashinfer: init_cuda_graph_state(max_bs, max_tokens) must run before capture")
        if batch.batch_size > self.static.max_bs:
            raise MmgenError(
                f"flashinfer: batch of {batch.batch_size} > CUDA-graph buffers for {self.static.max_bs}"
            )
        meta = self._compute(batch)
        key = (batch.batch_size, meta.is_decode)
        if capture:
            self.graph_wrappers[key] = {
                n: self._make_wrappers(n, self.static, batch.batch_size) for n in self.specs
            }
            self.graph_structure[key] = self._structure(meta)
        elif key not in self.graph_wrappers:
            raise MmgenError(
                f"flashinfer: no captured graph for batch size {key[0]} ({batch.forward_mode.name})"
            )
        elif self._structure(meta) != self.graph_structure[key]:
            raise MmgenError(
                f"flashinfer: a {batch.forward_mode.name} graph captured with prefix calls "
                f"{self.graph_structure[key]} cannot replay a batch needing {self._structure(meta)}"
            )
        self._plan(meta, self.graph_wrappers[key])
        self.metadata, self.active = meta, self.graph_wrappers[key]

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_step(batch, capture=True)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_step(batch, capture=False)

    # -- attention --------------------------------------------------------------------------------

    def _kv(self, layer: AttentionLayer) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_pool.k_pages(layer.layer_id), self.kv_pool.v_pages(layer.layer_id)

    def _metadata(self) -> FlashInferMetadata:
        if self.metadata is None:
            raise MmgenError("flashinfer: init_forward_metadata(batch) must run before forward")
        return self.metadata

    def _check_cross(self, meta: FlashInferMetadata, layer: AttentionLayer) -> None:
        if layer.is_cross_attention and meta.cross is None:
            raise MmgenError(f"layer {layer.layer_id}: cross-attention in a batch without encoder_lens")

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        """q [B, Hq, D] -> [B, Hq, D]."""
        self._check_cross(self._metadata(), layer)
        if not layer.is_cross_attention and save_kv_cache:
            self.save_kv(layer, batch.out_cache_loc, k, v)
        return self.active[_set_name(layer)].decode.run(q, self._kv(layer))

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, save_kv_cache: bool = True):
        """q [T, Hq, D] (+ k/v [T, Hk, D] for self layers) -> [T, Hq, D]."""
        meta = self._metadata()
        self._check_cross(meta, layer)
        name = _set_name(layer)
        w = self.active[name]
        if name == "cross":
            return w.paged.run(q, self._kv(layer))
        if save_kv_cache:
            self.save_kv(layer, batch.out_cache_loc, k, v)
        out, lse = w.ragged.run(q, k.to(q.dtype), v.to(q.dtype), return_lse=True)
        if getattr(meta, name).paged is None:
            return out
        prefix_out, prefix_lse = w.paged.run(q, self._kv(layer), return_lse=True)
        merged, _ = self.provider.merge_state(out, lse, prefix_out, prefix_lse)
        return merged
