"""Pure-torch references of the FlashInfer attention wrappers and merge_state (the CPU path and the test oracle).

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
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.kernels.contract import KernelContractError, KernelUnavailableError, gpu_kernels_apply
from mmgen.kernels.flash_attn import attend_one

LOG2E = 1.4426950408889634  # log2(e): FlashInfer LSE = natural LSE * LOG2E

_FI_VERSION = "flashinfer-python 0.7.2.post1"
_KV_LAYOUTS = ("NHD", "HND")


def _canonical_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise KernelContractError(f"unknown data type {dtype!r}")
    return found


def _unpack_paged_kv_cache(
    paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_layout: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) caches as NHD views [num_pages, page_size, Hk, D]."""
    if isinstance(paged_kv_cache, tuple):
        k_cache, v_cache = paged_kv_cache
    elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.dim() == 5:
        k_cache, v_cache = paged_kv_cache.unbind(dim=1)
    else:
        raise KernelContractError("paged_kv_cache must be a (k_cache, v_cache) tuple or one 5-D tensor")
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    return k_cache, v_cache


def _unpack_bits(packed: torch.Tensor, byte_offset: int, count: int) -> torch.Tensor:
    """`count` bits starting at byte `byte_offset` of a uint8 tensor, little bit order -> bool [count]."""
    n_bytes = (count + 7) // 8
    if byte_offset < 0 or byte_offset + n_bytes > packed.numel():
        raise KernelContractError(
            f"the custom mask segment at byte {byte_offset} (+{n_bytes}) lies outside the packed mask of "
            f"{packed.numel()} bytes"
        )
    chunk = packed[byte_offset : byte_offset + n_bytes].to(torch.int32)
    bits = (chunk[:, None] >> torch.arange(8, device=packed.device)[None, :]) & 1
    return bits.reshape(-1)[:count].bool()


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


@dataclass(frozen=True)
class WrapperPlan:
    """What a reference wrapper's plan() saw (host copies); run() checks the device metadata still says this.

    Backend tests read it through `wrapper.plan_info` (e.g. the window_left each wrapper was planned with).
    """

    qo_indptr: tuple[int, ...]
    kv_indptr: tuple[int, ...]
    kv_indices: tuple[int, ...]
    last_page_len: tuple[int, ...]
    mask_indptr: tuple[int, ...] | None
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    page_size: int
    causal: bool
    window_left: int
    logits_soft_cap: float
    sm_scale: float
    q_data_type: torch.dtype
    kv_data_type: torch.dtype
    o_data_type: torch.dtype
    q_len_per_req: int


def _paged_kv_len(indptr: Sequence[int], last_page_len: Sequence[int], page_size: int, i: int) -> int:
    pages = indptr[i + 1] - indptr[i]
    return 0 if pages == 0 else (pages - 1) * page_size + last_page_len[i]


class _Wrapper:
    """Shared state and checks of the three reference wrappers."""

    _name = "wrapper"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str,
        use_cuda_graph: bool,
        buffers: dict[str, torch.Tensor | None],
        fixed_by: str,
        call_counter: collections.Counter | None,
    ) -> None:
        if kv_layout not in _KV_LAYOUTS:
            raise KernelContractError(f"kv_layout {kv_layout!r} is not one of {', '.join(_KV_LAYOUTS)}")
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = use_cuda_graph
        self._buffers = dict(buffers)
        self._plan: WrapperPlan | None = None
        self._max_total_num_rows: int | None = None
        self.calls = call_counter if call_counter is not None else collections.Counter()
        self._fixed_batch_size = 0
        if use_cuda_graph:
            for name, buf in buffers.items():
                if name in ("custom_mask", "mask_indptr"):
                    continue  # optional, only needed when a custom mask is planned
                if not isinstance(buf, torch.Tensor):
                    raise KernelContractError(f"{name} buffer should be a torch.Tensor in CUDA graph mode")
            fixed = buffers[fixed_by]
            self._fixed_batch_size = len(fixed) - (1 if fixed_by.endswith("indptr") else 0)

    @property
    def plan_info(self) -> WrapperPlan | None:
        """The last plan() of this wrapper (None before the first); a reference-only convenience for tests."""
        return self._plan

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether plan() writes into the constructor's static buffers."""
        return self._use_cuda_graph

    def _store(self, name: str, value: torch.Tensor) -> None:
        """Keep a planned index tensor where run() reads it: the static buffer in graph mode."""
        if not self._use_cuda_graph:
            self._buffers[name] = value.to(self.device)
            return
        buf = self._buffers.get(name)
        if not isinstance(buf, torch.Tensor):
            raise KernelContractError(
                f"{name} buffer must be given to the constructor to plan it in CUDA graph mode"
            )
        if value.numel() > buf.numel():
            raise KernelContractError(
                f"{name} needs {value.numel()} entries but its buffer holds {buf.numel()}"
            )
        buf[: value.numel()].copy_(value)

    def _read(self, name: str, count: int) -> list[int]:
        buf = self._buffers[name]
        return buf[:count].tolist() if self._use_cuda_graph else buf.tolist()

    def _check_batch(self, batch: int, total_rows: int) -> None:
        if not self._use_cuda_graph:
            return
        if batch != self._fixed_batch_size:
            raise KernelContractError(
                f"the batch size is fixed at {self._fixed_batch_size} in CUDA graph mode; plan got {batch}"
            )
        if self._max_total_num_rows is None:
            self._max_total_num_rows = total_rows
        elif total_rows > self._max_total_num_rows:
            raise KernelContractError(
                f"{total_rows} query rows exceed the {self._max_total_num_rows} set by the first plan in CUDA graph mode"
            )

    def _planned(self) -> WrapperPlan:
        if self._plan is None:
            raise KernelContractError(f"{self._name}.run() before plan()")
        return self._plan

    def _check_run(self, q: torch.Tensor, k_cache: torch.Tensor, window_left: int | None) -> WrapperPlan:
        plan = self._planned()
        if q.dtype != plan.q_data_type:
            raise KernelContractError(
                f"The dtype of q {q.dtype} does not match the q_data_type {plan.q_data_type} specified in plan function."
            )
        if k_cache.dtype != plan.kv_data_type:
            raise KernelContractError(
                f"The dtype of k {k_cache.dtype} does not match the kv_data_type {plan.kv_data_type} specified in plan function."
            )
        if window_left is not None and window_left != plan.window_left:
            raise KernelContractError(
                f"run(window_left={window_left}) differs from plan(window_left={plan.window_left}): "
                "FlashInfer asserts they are equal"
            )
        if q.shape[-2] != plan.num_qo_heads or k_cache.shape[-2] != plan.num_kv_heads:
            raise KernelContractError(
                f"run got {q.shape[-2]} query / {k_cache.shape[-2]} kv heads, plan said {plan.num_qo_heads} / {plan.num_kv_heads}"
            )
        if q.shape[-1] != plan.head_dim_qk:
            raise KernelContractError(
                f"q head_dim {q.shape[-1]} differs from plan's head_dim {plan.head_dim_qk}"
            )
        return plan

    def _check_unchanged(self, plan: WrapperPlan, **current: tuple[int, ...] | None) -> None:
        changed = [name for name, value in current.items() if value != getattr(plan, name)]
        if changed:
            raise KernelContractError(
                f"{', '.join(changed)} changed after plan(): call plan() again for this batch "
                "(the real kernels would run the old schedule)"
            )

    def _mask_for(
        self, plan: WrapperPlan, i: int, qo_len: int, kv_len: int, packed: torch.Tensor | None
    ) -> torch.Tensor | None:
        if plan.mask_indptr is None or packed is None:
            return None
        bits = _unpack_bits(packed, plan.mask_indptr[i], qo_len * kv_len)
        return bits.reshape(qo_len, kv_len)

    def _attend(
        self,
        plan: WrapperPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One request: q [qo, Hq, D], k/v [kv, Hk, D] -> (out fp32 [qo, Hq, Dv], natural lse [qo, Hq])."""
        if q.shape[0] == 0:
            return q.new_zeros(0, q.shape[1], v.shape[-1], dtype=torch.float32), q.new_zeros(
                0, q.shape[1]
            ).float()
        out, lse = attend_one(
            q,
            k,
            v,
            scale=plan.sm_scale,
            causal=causal and mask is None,
            window_left=plan.window_left,
            softcap=plan.logits_soft_cap,
            mask=mask,
        )
        return out, lse.transpose(0, 1)

    def _finish(
        self,
        plan: WrapperPlan,
        out: torch.Tensor,
        lse: torch.Tensor,
        out_buf: torch.Tensor | None,
        lse_buf: torch.Tensor | None,
        return_lse: bool,
        lse_base: str = "log2",
        lse_layout: str = "NH",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if lse_base not in ("log2", "ln"):
            raise KernelContractError(f"lse_base {lse_base!r} is not one of log2, ln")
        if lse_layout not in ("NH", "HN"):
            raise KernelContractError(f"lse_layout {lse_layout!r} is not one of NH, HN")
        out = out.to(plan.o_data_type)
        if out_buf is not None:
            out = out_buf.copy_(out)
        if not return_lse:
            return out
        lse = lse * LOG2E if lse_base == "log2" else lse
        lse = lse.transpose(0, 1).contiguous() if lse_layout == "HN" else lse
        if lse_buf is not None:
            lse = lse_buf.copy_(lse)
        return out, lse

    def run_return_lse(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """run(..., return_lse=True)."""
        return self.run(*args, return_lse=True, **kwargs)


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


class BatchPrefillWithRaggedKVCacheWrapper(_Wrapper):
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
        _reject_jit(jit_args)
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
        self.calls[f"{self._name}.plan"] += 1
        _reject_pos_encoding(pos_encoding_mode)
        qo, kv = tuple(qo_indptr.tolist()), tuple(kv_indptr.tolist())
        if len(qo) != len(kv):
            raise KernelContractError(f"qo_indptr has {len(qo)} entries but kv_indptr {len(kv)}")
        batch = len(qo) - 1
        self._check_batch(batch, qo[-1])
        qo_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        kv_lens = [kv[i + 1] - kv[i] for i in range(batch)]
        packed, mask_indptr = _plan_masks(custom_mask, packed_custom_mask, qo_lens, kv_lens)
        self._store("qo_indptr", qo_indptr)
        self._store("kv_indptr", kv_indptr)
        if packed is not None:
            self._store("custom_mask", packed)
            self._store("mask_indptr", mask_indptr)
        q_dtype = _canonical_dtype(q_data_type)
        self._plan = WrapperPlan(
            qo_indptr=qo,
            kv_indptr=kv,
            kv_indices=(),
            last_page_len=(),
            mask_indptr=tuple(mask_indptr.tolist()) if mask_indptr is not None else None,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo or head_dim_qk,
            page_size=0,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk),
            q_data_type=q_dtype,
            kv_data_type=_canonical_dtype(kv_data_type) if kv_data_type is not None else q_dtype,
            o_data_type=_canonical_dtype(o_data_type) if o_data_type is not None else q_dtype,
            q_len_per_req=0,
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
        self.calls[f"{self._name}.run"] += 1
        _reject_extras(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, o_scale=o_scale)
        plan = self._check_run(q, k, None)
        batch = len(plan.qo_indptr) - 1
        qo = tuple(self._read("qo_indptr", batch + 1))
        kv = tuple(self._read("kv_indptr", batch + 1))
        self._check_unchanged(plan, qo_indptr=qo, kv_indptr=kv)
        if q.shape[0] != qo[-1]:
            raise KernelContractError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({qo[-1]})")
        packed = self._buffers.get("custom_mask") if plan.mask_indptr is not None else None
        out_f = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32)
        lse_f = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
        for i in range(batch):
            kb, vb = k[kv[i] : kv[i + 1]], v[kv[i] : kv[i + 1]]
            mask = self._mask_for(plan, i, qo[i + 1] - qo[i], kv[i + 1] - kv[i], packed)
            o_i, l_i = self._attend(plan, q[qo[i] : qo[i + 1]], kb, vb, mask, plan.causal)
            out_f[qo[i] : qo[i + 1]], lse_f[qo[i] : qo[i + 1]] = o_i, l_i
        return self._finish(plan, out_f, lse_f, out, lse, return_lse, lse_base, lse_layout)


class _PagedMixin:
    """Reads each request's keys through indptr / indices / last_page_len."""

    def _paged_kv(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: WrapperPlan, i: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pages = plan.kv_indices[plan.kv_indptr[i] : plan.kv_indptr[i + 1]]
        length = _paged_kv_len(plan.kv_indptr, plan.last_page_len, plan.page_size, i)
        if pages and (min(pages) < 0 or max(pages) >= k_cache.shape[0]):
            raise KernelContractError(
                f"request {i} names pages {min(pages)}..{max(pages)} outside the cache's {k_cache.shape[0]} pages"
            )
        index = torch.tensor(pages, dtype=torch.long, device=k_cache.device)
        kb = k_cache[index].reshape(-1, *k_cache.shape[2:])[:length]
        vb = v_cache[index].reshape(-1, *v_cache.shape[2:])[:length]
        return kb, vb


def _check_paged_layout(indptr: Sequence[int], indices_len: int, last: Sequence[int], page_size: int) -> None:
    if len(last) != len(indptr) - 1:
        raise KernelContractError(f"last_page_len has {len(last)} entries for {len(indptr) - 1} requests")
    if indptr[-1] > indices_len:
        raise KernelContractError(f"indptr[-1]={indptr[-1]} exceeds the {indices_len} page indices")
    for i in range(len(last)):
        if indptr[i + 1] > indptr[i] and not 1 <= last[i] <= page_size:
            raise KernelContractError(f"last_page_len[{i}]={last[i]} must be in [1, page_size={page_size}]")


class BatchPrefillWithPagedKVCacheWrapper(_PagedMixin, _Wrapper):
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
        _reject_jit(jit_args)
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
        self.calls[f"{self._name}.plan"] += 1
        _reject_pos_encoding(pos_encoding_mode)
        qo = tuple(qo_indptr.tolist())
        indptr = tuple(paged_kv_indptr.tolist())
        indices = tuple(paged_kv_indices.tolist())
        last = tuple(paged_kv_last_page_len.tolist())
        if len(qo) != len(indptr):
            raise KernelContractError("The length of qo_indptr and paged_kv_indptr should be the same.")
        _check_paged_layout(indptr, len(indices), last, page_size)
        batch = len(qo) - 1
        self._check_batch(batch, qo[-1])
        qo_lens = [qo[i + 1] - qo[i] for i in range(batch)]
        mask_kv_lens = [(indptr[i + 1] - indptr[i] - 1) * page_size + last[i] for i in range(batch)]
        packed, mask_indptr = _plan_masks(custom_mask, packed_custom_mask, qo_lens, mask_kv_lens)
        self._store("qo_indptr", qo_indptr)
        self._store("paged_kv_indptr", paged_kv_indptr)
        self._store("paged_kv_indices", paged_kv_indices)
        self._store("paged_kv_last_page_len", paged_kv_last_page_len)
        if packed is not None:
            self._store("custom_mask", packed)
            self._store("mask_indptr", mask_indptr)
        q_dtype = _canonical_dtype(q_data_type)
        self._plan = WrapperPlan(
            qo_indptr=qo,
            kv_indptr=indptr,
            kv_indices=indices[: indptr[-1]],
            last_page_len=last,
            mask_indptr=tuple(mask_indptr.tolist()) if mask_indptr is not None else None,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo or head_dim_qk,
            page_size=page_size,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk),
            q_data_type=q_dtype,
            kv_data_type=_canonical_dtype(kv_data_type) if kv_data_type is not None else q_dtype,
            o_data_type=_canonical_dtype(o_data_type) if o_data_type is not None else q_dtype,
            q_len_per_req=0,
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
        self.calls[f"{self._name}.run"] += 1
        _reject_extras(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        plan = self._check_run(q, k_cache, window_left)
        if k_cache.shape[1] != plan.page_size:
            raise KernelContractError(
                f"the cache's page_size {k_cache.shape[1]} differs from plan's {plan.page_size}"
            )
        batch = len(plan.qo_indptr) - 1
        self._check_unchanged(
            plan,
            qo_indptr=tuple(self._read("qo_indptr", batch + 1)),
            kv_indptr=tuple(self._read("paged_kv_indptr", batch + 1)),
            kv_indices=tuple(self._read("paged_kv_indices", plan.kv_indptr[-1])[: plan.kv_indptr[-1]]),
            last_page_len=tuple(self._read("paged_kv_last_page_len", batch)),
        )
        qo = plan.qo_indptr
        if q.shape[0] != qo[-1]:
            raise KernelContractError(f"q.shape[0] ({q.shape[0]}) does not match qo_indptr[-1] ({qo[-1]})")
        packed = self._buffers.get("custom_mask") if plan.mask_indptr is not None else None
        out_f = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float32)
        lse_f = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
        for i in range(batch):
            kb, vb = self._paged_kv(k_cache, v_cache, plan, i)
            mask = self._mask_for(plan, i, qo[i + 1] - qo[i], kb.shape[0], packed)
            o_i, l_i = self._attend(plan, q[qo[i] : qo[i + 1]], kb, vb, mask, plan.causal)
            out_f[qo[i] : qo[i + 1]], lse_f[qo[i] : qo[i + 1]] = o_i, l_i
        return self._finish(plan, out_f, lse_f, out, lse, return_lse, lse_base, lse_layout)


class BatchDecodeWithPagedKVCacheWrapper(_PagedMixin, _Wrapper):
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
        _reject_jit(jit_args)
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
        self.calls[f"{self._name}.plan"] += 1
        _reject_pos_encoding(pos_encoding_mode)
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
        ind = tuple(indptr.tolist())
        pages = tuple(indices.tolist())
        last = tuple(last_page_len.tolist())
        _check_paged_layout(ind, len(pages), last, page_size)
        batch = len(last)
        self._check_batch(batch, batch * q_len_per_req)
        if self._use_cuda_graph and len(pages) > len(self._buffers["paged_kv_indices"]):
            raise KernelContractError("The length of paged_kv_indices exceeds the allocated buffer size.")
        self._store("paged_kv_indptr", indptr)
        self._store("paged_kv_indices", indices)
        self._store("paged_kv_last_page_len", last_page_len)
        if data_type is not None:
            q_data_type = q_data_type or data_type
            kv_data_type = kv_data_type or data_type
        q_dtype = _canonical_dtype(q_data_type)
        self._plan = WrapperPlan(
            qo_indptr=tuple(range(0, (batch + 1) * q_len_per_req, q_len_per_req)),
            kv_indptr=ind,
            kv_indices=pages[: ind[-1]],
            last_page_len=last,
            mask_indptr=None,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim,
            head_dim_vo=head_dim,
            page_size=page_size,
            causal=causal,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap or 0.0,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
            q_data_type=q_dtype,
            kv_data_type=_canonical_dtype(kv_data_type) if kv_data_type is not None else q_dtype,
            o_data_type=_canonical_dtype(o_data_type) if o_data_type is not None else q_dtype,
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
        self.calls[f"{self._name}.run"] += 1
        _reject_extras(args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, sinks=sinks)
        k_cache, v_cache = _unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        plan = self._check_run(q, k_cache, window_left)
        if k_cache.shape[1] != plan.page_size:
            raise KernelContractError(
                f"the cache's page_size {k_cache.shape[1]} differs from plan's {plan.page_size}"
            )
        batch = len(plan.last_page_len)
        self._check_unchanged(
            plan,
            kv_indptr=tuple(self._read("paged_kv_indptr", batch + 1)),
            kv_indices=tuple(self._read("paged_kv_indices", plan.kv_indptr[-1])[: plan.kv_indptr[-1]]),
            last_page_len=tuple(self._read("paged_kv_last_page_len", batch)),
        )
        if q.shape[0] != batch * plan.q_len_per_req:
            raise KernelContractError(
                f"q.shape[0] ({q.shape[0]}) is not batch_size * q_len_per_req ({batch} * {plan.q_len_per_req})"
            )
        n = plan.q_len_per_req
        out_f = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=torch.float32)
        lse_f = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
        for i in range(batch):
            kb, vb = self._paged_kv(k_cache, v_cache, plan, i)
            o_i, l_i = self._attend(plan, q[i * n : (i + 1) * n], kb, vb, None, plan.causal)
            out_f[i * n : (i + 1) * n], lse_f[i * n : (i + 1) * n] = o_i, l_i
        return self._finish(plan, out_f, lse_f, out, lse, return_lse)


def _reject_jit(jit_args: list[Any] | None) -> None:
    if jit_args is not None:
        raise KernelContractError(
            "the reference wrappers run the default attention variant only (jit_args given)"
        )


def _reject_pos_encoding(pos_encoding_mode: str) -> None:
    if pos_encoding_mode != "NONE":
        raise KernelContractError(
            f"the reference wrappers do not apply position encodings (pos_encoding_mode={pos_encoding_mode!r})"
        )


def _reject_extras(args: tuple[Any, ...], **values: Any) -> None:
    if args:
        raise KernelContractError("the reference wrappers take no extra positional run() arguments")
    for name, value in values.items():
        if value is not None:
            raise KernelContractError(f"the reference wrappers do not implement {name}")


# ---------------------------------------------------------------------------------------------------
# merge_state (cascade.py), base-2 LSE


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: v [N, H, D] (v_a's dtype out), s float32 [N, H] base-2 LSE -> (v, s).

    Equals attention over the union of both key sets. An empty side (s = -inf) contributes nothing;
    two empty sides give v 0 and s -inf, as the FlashInfer kernel guards.
    """
    s_a, s_b = s_a.float(), s_b.float()
    s_max = torch.maximum(s_a, s_b)
    finite_max = torch.where(torch.isfinite(s_max), s_max, torch.zeros_like(s_max))
    w_a = torch.exp2(s_a - finite_max)
    w_b = torch.exp2(s_b - finite_max)
    total = w_a + w_b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    v = (v_a.float() * (w_a / safe)[..., None] + v_b.float() * (w_b / safe)[..., None]).to(v_a.dtype)
    s = torch.where(total > 0, torch.log2(safe) + finite_max, torch.full_like(s_max, float("-inf")))
    return v, s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge (v_other, s_other) into (v [N, H, D], s [N, H]) in place; mask bool [N] picks the rows to merge."""
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    if mask is not None:
        merged_v = torch.where(mask[:, None, None], merged_v, v)
        merged_s = torch.where(mask[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge several states: v [N, S, H, D], s [N, S, H] base 2 -> (v [N, H, D], s [N, H])."""
    s = s.float()
    total = torch.logsumexp(s / LOG2E, dim=1)  # natural
    weights = torch.exp(s / LOG2E - total[:, None].clamp_min(torch.finfo(torch.float32).min))
    weights = torch.nan_to_num(weights, nan=0.0)
    merged = (v.float() * weights[..., None]).sum(dim=1).to(v.dtype)
    return merged, total * LOG2E


# ---------------------------------------------------------------------------------------------------
# Providers


class ReferenceFlashInfer:
    """The references behind FlashInfer's names. `calls` counts wrapper plan/run calls
    ("BatchDecodeWithPagedKVCacheWrapper.plan", ...) and merge_state calls."""

    name = "reference"
    version = f"mmgen reference of {_FI_VERSION}"

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def BatchPrefillWithRaggedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchPrefillWithRaggedKVCacheWrapper:
        """A reference ragged prefill wrapper (same constructor arguments as FlashInfer's)."""
        return BatchPrefillWithRaggedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def BatchPrefillWithPagedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchPrefillWithPagedKVCacheWrapper:
        """A reference paged prefill wrapper (same constructor arguments as FlashInfer's)."""
        return BatchPrefillWithPagedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def BatchDecodeWithPagedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchDecodeWithPagedKVCacheWrapper:
        """A reference paged decode wrapper (same constructor arguments as FlashInfer's)."""
        return BatchDecodeWithPagedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def merge_state(
        self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See the module function `merge_state`."""
        self.calls["merge_state"] += 1
        return merge_state(v_a, s_a, v_b, s_b)


class FlashInferLibrary:
    """The installed flashinfer package behind the same names. `calls` counts wrapper constructions
    and merge_state calls (the library's own wrappers do not count plan/run)."""

    name = "flashinfer"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.version = f"flashinfer {getattr(module, '__version__', 'unknown')}"
        self.calls: collections.Counter = collections.Counter()

    def BatchPrefillWithRaggedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchPrefillWithRaggedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchPrefillWithRaggedKVCacheWrapper"] += 1
        return self.module.BatchPrefillWithRaggedKVCacheWrapper(*args, **kwargs)

    def BatchPrefillWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchPrefillWithPagedKVCacheWrapper"] += 1
        return self.module.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)

    def BatchDecodeWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchDecodeWithPagedKVCacheWrapper"] += 1
        return self.module.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)

    def merge_state(
        self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """flashinfer.merge_state (base-2 LSE)."""
        self.calls["merge_state"] += 1
        return self.module.merge_state(v_a, s_a, v_b, s_b)


_PROVIDER_NAMES = ("auto", "flashinfer", "reference")


def load_flashinfer_provider(
    name: str = "auto", *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> ReferenceFlashInfer | FlashInferLibrary:
    """The FlashInfer provider called `name` ("auto" | "flashinfer" | "reference").

    "auto" is flashinfer when it imports, a CUDA device exists and the data (device/dtype, None =
    unknown) is CUDA bf16/fp16, else the reference; "flashinfer" raises KernelUnavailableError when
    the library or the device is missing.
    """
    if name not in _PROVIDER_NAMES:
        raise ValidationError(
            f"unknown FlashInfer provider {name!r}: expected one of {', '.join(_PROVIDER_NAMES)}"
        )
    if name == "reference":
        return ReferenceFlashInfer()
    if name == "auto" and not gpu_kernels_apply(device, dtype):
        return ReferenceFlashInfer()
    if not torch.cuda.is_available():
        if name == "auto":
            return ReferenceFlashInfer()
        raise KernelUnavailableError(
            "FlashInfer provider 'flashinfer' needs a CUDA device; none is available"
        )
    try:
        module = importlib.import_module("flashinfer")
    except (ImportError, OSError, RuntimeError) as err:
        if name == "auto":
            return ReferenceFlashInfer()
        raise KernelUnavailableError(
            f"FlashInfer provider 'flashinfer' is not installed (pip install flashinfer-python): {err}"
        ) from err
    return FlashInferLibrary(module)
