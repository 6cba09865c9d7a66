"""Pure-torch references of the FlashInfer attention wrappers (the CPU path and the test oracle).

merge_state and the provider objects live in `mmgen.kernels.flashinfer_providers`.

Matched against flashinfer-python 0.7.2.post1 (flashinfer/prefill.py, decode.py, cascade.py and the
kernels' mask in include/flashinfer/attention/variants.cuh). Every run computes in fp32 and returns
o_data_type (default: q_data_type). Semantics, as in FlashInfer:
- Wrappers are built once, `plan(...)` once per batch (host metadata), `run(...)` per layer. run checks
  q's and the cache's dtypes against plan's q_data_type / kv_data_type (default "float16", so a
  bfloat16 or float32 caller must say so in plan), and a run-time window_left must equal plan's.
- Paged KV in "NHD" layout: (k_cache, v_cache) each [num_pages, page_size, Hk, D], or one tensor
  [num_pages, 2, page_size, Hk, D]; "HND" swaps page_size and Hk. Request i owns pages
  indices[indptr[i]:indptr[i+1]]; its KV length is (num_pages_i - 1) * page_size + last_page_len[i],
  or 0 with no pages.
- Masks are aligned bottom-right: query i of qo_len sits at position kv_len - qo_len + i. causal keeps
  keys j <= that position; window_left >= 0 keeps keys j >= position - window_left (window_left + 1
  keys including the query's own position; -1 = unbounded); custom_mask (flattened bool, request by
  request, each qo_len x kv_len row-major) replaces causal but the window still applies.
- logits_soft_cap > 0: logits = cap * tanh(sm_scale * q.k / cap); sm_scale defaults to 1/sqrt(head_dim).
- LSE is base 2 (log2 of the sum of 2^(logit * log2 e)): natural-log LSE times log2(e).
  Prefill run returns lse [nnz_q, Hq] ("NH"; lse_layout="HN" gives [Hq, nnz_q], lse_base="ln" the
  natural log); decode run returns lse [batch * q_len_per_req, Hq]. A query that sees no key gets
  output 0 and LSE -inf, which merge_state treats as an empty state.
- use_cuda_graph=True: the batch size is fixed by the buffers given to the constructor, plan copies its
  metadata into them and run reads the buffers. Changing a planned index tensor without planning
  again raises (the real kernels would run a stale schedule).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import torch

from mmgen.kernels.contract import KernelContractError
from mmgen.kernels.flashinfer_wrapper import (
    LOG2E,
    PagedWrapper,
    ReferenceWrapper,
    WrapperPlan,
    read_paged_layout,
    reject_jit,
)

__all__ = [
    "LOG2E",
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "FLASHINFER_VERSION",
    "WrapperPlan",
]

# The library version these references were matched against.
FLASHINFER_VERSION = "flashinfer-python 0.7.2.post1"


def _pack_segments(mask: torch.Tensor, lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """flashinfer.segment_packbits(mask, indptr, "little"): each segment padded to whole bytes."""
    packed, offsets, start = [], [0], 0
    for n in lengths:
        bits = mask[start : start + n].to(torch.uint8)
        start += n
        padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
        padded[:n] = bits
        weights = (1 << torch.arange(8, device=mask.device)).to(torch.uint8)
        packed.append((padded.reshape(-1, 8) * weights).sum(dim=1).to(torch.uint8))
        offsets.append(offsets[-1] + (n + 7) // 8)
    flat = torch.cat(packed) if packed else torch.zeros(0, dtype=torch.uint8, device=mask.device)
    return flat, torch.tensor(offsets, dtype=torch.int32, device=mask.device)


def _plan_masks(
    custom_mask: torch.Tensor | None,
    packed_custom_mask: torch.Tensor | None,
    qo_lens: Sequence[int],
    mask_kv_lens: Sequence[int],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(packed mask, mask_indptr) as FlashInfer's plan builds them, or (None, None) without a custom mask.

    As in flashinfer 0.7.2.post1: a bool custom_mask is packed per request to whole bytes with byte
    offsets; a caller-packed mask keeps the bit-count offsets plan computes, which the kernel reads as
    byte offsets (so for batch > 1 pass custom_mask, not packed_custom_mask).
    """
    if custom_mask is None and packed_custom_mask is None:
        return None, None
    segments = [q * k for q, k in zip(qo_lens, mask_kv_lens, strict=True)]
    if any(n < 0 for n in segments):
        bad = next(i for i, n in enumerate(segments) if n < 0)
        raise KernelContractError(
            f"request {bad} has no pages and a last_page_len below page_size: FlashInfer's custom-mask "
            "offsets ((pages - 1) * page_size + last_page_len) go negative"
        )
    if packed_custom_mask is not None:
        offsets = [0]
        for n in segments:
            offsets.append(offsets[-1] + n)
        return packed_custom_mask, torch.tensor(offsets, dtype=torch.int32, device=packed_custom_mask.device)
    flat = custom_mask.reshape(-1)
    if flat.numel() != sum(segments):
        raise KernelContractError(
            f"custom_mask has {flat.numel()} entries, expected sum(qo_len * kv_len) = {sum(segments)}"
        )
    return _pack_segments(flat.bool(), segments)


class _PrefillWrapper(ReferenceWrapper):
    """What ragged and paged prefill plans share: per-request query rows, the custom mask, the buffers."""

    def _plan_prefill(
        self,
        qo_indptr: torch.Tensor,
        mask_kv_lens: Sequence[int],
        custom_mask: torch.Tensor | None,
        packed_custom_mask: torch.Tensor | None,
        kv_buffers: dict[str, torch.Tensor],
        **fields: Any,
    ) -> None:
        """Check the batch, pack the custom mask, store qo_indptr + kv_buffers where run() reads them, keep the plan."""
        qo = tuple(qo_indptr.tolist())
        batch = len(qo) - 1
        self._check_batch(batch, qo[-1])
        qo_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        packed, mask_indptr = _plan_masks(custom_mask, packed_custom_mask, qo_lens, mask_kv_lens)
        for name, value in {"qo_indptr": qo_indptr, **kv_buffers}.items():
            self._store(name, value)
        if packed is not None:
            self._store("custom_mask", packed)
            self._store("mask_indptr", mask_indptr)
        mask_offsets = tuple(mask_indptr.tolist()) if mask_indptr is not None else None
        self._keep_plan(qo_indptr=qo, mask_indptr=mask_offsets, q_len_per_req=0, **fields)

    @staticmethod
    def _check_q_rows(q: torch.Tensor, plan: WrapperPlan) -> None:
        if q.shape[0] != plan.qo_indptr[-1]:
            raise KernelContractError(
                f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({plan.qo_indptr[-1]})"
            )


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapper):
    """FlashInfer's ragged prefill: q [nnz_q, Hq, D] by qo_indptr, k/v [nnz_kv, Hk, D] by kv_indptr."""

    _name = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
        *,
        call_counter: collections.Counter | None = None,
    ) -> None:
        reject_jit(jit_args)
        buffers = dict(
            qo_indptr=qo_indptr_buf,
            kv_indptr=kv_indptr_buf,
            custom_mask=custom_mask_buf,
            mask_indptr=mask_indptr_buf,
        )
        super().__init__(
            float_workspace_buffer, kv_layout, use_cuda_graph, buffers, "qo_indptr", call_counter
        )

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        *,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan ragged prefill: qo_indptr, kv_indptr int32 [B + 1]; custom_mask bool [sum qo_len * kv_len]."""
        self._begin_plan(pos_encoding_mode)
        qo, kv = tuple(qo_indptr.tolist()), tuple(kv_indptr.tolist())
        if len(qo) != len(kv):
            raise KernelContractError(f"qo_indptr has {len(qo)} entries but kv_indptr {len(kv)}")
        self._plan_prefill(
            qo_indptr,
            [kv[i + 1] - kv[i] for i in range(len(kv) - 1)],
            custom_mask,
            packed_custom_mask,
            {"kv_indptr": kv_indptr},
            kv_indptr=kv,
            kv_indices=(),
            last_page_len=(),
            page_size=0,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
        )

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        o_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [nnz_q, Hq, D], k/v [nnz_kv, Hk, D] -> out [nnz_q, Hq, Dv] (+ lse [nnz_q, Hq] base 2)."""
        self._begin_run(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale)
        plan = self._check_run(q, k, None)
        batch = len(plan.qo_indptr) - 1
        qo = tuple(self._read("qo_indptr", batch + 1))
        kv = tuple(self._read("kv_indptr", batch + 1))
        self._check_unchanged(plan, qo_indptr=qo, kv_indptr=kv)
        self._check_q_rows(q, plan)
        out_f, lse_f = self._attend_requests(
            plan, q, v.shape[-1], lambda i: (k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]])
        )
        return self._finish(plan, out_f, lse_f, out, lse, return_lse, lse_base, lse_layout)


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapper, PagedWrapper):
    """FlashInfer's paged prefill: q [nnz_q, Hq, D] by qo_indptr against a paged KV cache."""

    _name = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        jit_kwargs: dict[str, Any] | None = None,
        *,
        call_counter: collections.Counter | None = None,
    ) -> None:
        reject_jit(jit_args)
        buffers = dict(
            qo_indptr=qo_indptr_buf,
            paged_kv_indptr=paged_kv_indptr_buf,
            paged_kv_indices=paged_kv_indices_buf,
            paged_kv_last_page_len=paged_kv_last_page_len_buf,
            custom_mask=custom_mask_buf,
            mask_indptr=mask_indptr_buf,
        )
        super().__init__(
            float_workspace_buffer, kv_layout, use_cuda_graph, buffers, "qo_indptr", call_counter
        )
        if use_cuda_graph:
            if len(paged_kv_indptr_buf) != self._fixed_batch_size + 1:
                raise KernelContractError("The length of paged_kv_indptr_buf should be batch_size + 1.")
            if len(paged_kv_last_page_len_buf) != self._fixed_batch_size:
                raise KernelContractError("The length of paged_kv_last_page_len_buf should be batch_size.")

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        *,
        seq_lens: torch.Tensor | None = None,
        block_tables: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan paged prefill: indptrs int32 [B + 1], indices int32 [indptr[-1]], last_page_len int32 [B]."""
        self._begin_plan(pos_encoding_mode)
        qo = tuple(qo_indptr.tolist())
        if len(qo) != len(paged_kv_indptr):
            raise KernelContractError("The length of qo_indptr and paged_kv_indptr should be the same.")
        indptr, indices, last = read_paged_layout(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size
        )
        self._plan_prefill(
            qo_indptr,
            [(indptr[i + 1] - indptr[i] - 1) * page_size + last[i] for i in range(len(last))],
            custom_mask,
            packed_custom_mask,
            self._page_buffers(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len),
            **self._page_fields(indptr, indices, last, page_size),
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
        )

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [nnz_q, Hq, D], paged (k, v) -> out [nnz_q, Hq, Dv] (+ lse [nnz_q, Hq] base 2)."""
        self._begin_run(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        batch = len(self._planned().qo_indptr) - 1
        qo = tuple(self._read("qo_indptr", batch + 1))
        plan, k_cache, v_cache = self._check_paged_run(q, paged_kv_cache, window_left, qo_indptr=qo)
        self._check_q_rows(q, plan)
        out_f, lse_f = self._attend_paged(plan, q, k_cache, v_cache)
        return self._finish(plan, out_f, lse_f, out, lse, return_lse, lse_base, lse_layout)


class BatchDecodeWithPagedKVCacheWrapper(PagedWrapper):
    """FlashInfer's paged decode: q [B * q_len_per_req, Hq, D], one (or q_len_per_req) query per request."""

    _name = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args: list[Any] | None = None,
        *,
        call_counter: collections.Counter | None = None,
    ) -> None:
        reject_jit(jit_args)
        buffers = dict(
            paged_kv_indptr=paged_kv_indptr_buffer,
            paged_kv_indices=paged_kv_indices_buffer,
            paged_kv_last_page_len=paged_kv_last_page_len_buffer,
        )
        super().__init__(
            float_workspace_buffer, kv_layout, use_cuda_graph, buffers, "paged_kv_last_page_len", call_counter
        )
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype | None = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables: torch.Tensor | None = None,
        seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        is_causal: bool | None = None,
    ) -> None:
        """Plan paged decode: indptr int32 [B + 1], indices int32 [indptr[-1]], last_page_len int32 [B]."""
        self._begin_plan(pos_encoding_mode)
        if window_right != 0:
            raise KernelContractError(
                "BatchDecodeWithPagedKVCacheWrapper only supports window_right=0 (cute-dsl aside)"
            )
        if q_len_per_req < 1:
            raise KernelContractError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
        if q_len_per_req > 1 and not self.use_tensor_cores:
            raise KernelContractError("q_len_per_req > 1 needs use_tensor_cores=True")
        causal = q_len_per_req > 1 if is_causal is None else is_causal
        if causal != (q_len_per_req > 1):
            raise KernelContractError(
                "is_causal must be q_len_per_req > 1 (the only mode the wrapper supports)"
            )
        ind, pages, last = read_paged_layout(indptr, indices, last_page_len, page_size)
        batch = len(last)
        self._check_batch(batch, batch * q_len_per_req)
        if self._use_cuda_graph and len(pages) > len(self._buffers["paged_kv_indices"]):
            raise KernelContractError("The length of paged_kv_indices exceeds the allocated buffer size.")
        for name, value in self._page_buffers(indptr, indices, last_page_len).items():
            self._store(name, value)
        if data_type is not None:
            q_data_type = q_data_type or data_type
            kv_data_type = kv_data_type or data_type
        self._keep_plan(
            qo_indptr=tuple(range(0, (batch + 1) * q_len_per_req, q_len_per_req)),
            **self._page_fields(ind, pages, last, page_size),
            mask_indptr=None,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim,
            head_dim_vo=head_dim,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            q_len_per_req=q_len_per_req,
        )

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        *args: Any,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl: bool | None = None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q [B * q_len_per_req, Hq, D], paged (k, v) -> out [B * q_len_per_req, Hq, D] (+ lse [.., Hq] base 2)."""
        self._begin_run(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        plan, k_cache, v_cache = self._check_paged_run(q, paged_kv_cache, window_left)
        batch = len(plan.last_page_len)
        if q.shape[0] != batch * plan.q_len_per_req:
            raise KernelContractError(
                f"q.shape[0] ({q.shape[0]}) is not batch_size * q_len_per_req ({batch} * {plan.q_len_per_req})"
            )
        out_f, lse_f = self._attend_paged(plan, q, k_cache, v_cache)
        return self._finish(plan, out_f, lse_f, out, lse, return_lse)
