"""The shared machinery of the FlashInfer reference wrappers: plan bookkeeping, run checks, one request's attention.

Each wrapper in `mmgen.kernels.flashinfer` keeps FlashInfer's constructor / plan / run signatures and
hands the work to `ReferenceWrapper` (CUDA-graph buffers, the stored plan, stale-plan checks, the
per-request loop, output dtype and LSE base/layout) and, for paged KV, `PagedWrapper`.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmgen.kernels.contract import KernelContractError
from mmgen.kernels.flash_attn import attend_one

LOG2E = 1.4426950408889634  # log2(e): FlashInfer LSE = natural LSE * LOG2E

_KV_LAYOUTS = ("NHD", "HND")


def canonical_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype, None)
    if not isinstance(found, torch.dtype):
        raise KernelContractError(f"unknown data type {dtype!r}")
    return found


def unpack_paged_kv_cache(
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


class ReferenceWrapper:
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

    def _begin_plan(self, pos_encoding_mode: str) -> None:
        self.calls[f"{self._name}.plan"] += 1
        reject_pos_encoding(pos_encoding_mode)

    def _keep_plan(
        self,
        *,
        head_dim_qk: int,
        head_dim_vo: int | None,
        logits_soft_cap: float | None,
        sm_scale: float | None,
        q_data_type: str | torch.dtype,
        kv_data_type: str | torch.dtype | None,
        o_data_type: str | torch.dtype | None,
        **layout: Any,
    ) -> None:
        """Store plan()'s result with FlashInfer's defaults resolved: head_dim_vo = head_dim_qk, no soft cap,
        sm_scale 1/sqrt(head_dim_qk), kv and output dtypes = q's."""
        q_dtype = canonical_dtype(q_data_type)
        self._plan = WrapperPlan(
            head_dim_qk=head_dim_qk,
            head_dim_vo=head_dim_vo or head_dim_qk,
            logits_soft_cap=logits_soft_cap or 0.0,
            sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim_qk),
            q_data_type=q_dtype,
            kv_data_type=canonical_dtype(kv_data_type) if kv_data_type is not None else q_dtype,
            o_data_type=canonical_dtype(o_data_type) if o_data_type is not None else q_dtype,
            **layout,
        )

    def _begin_run(self, args: tuple[Any, ...], **unsupported: Any) -> None:
        self.calls[f"{self._name}.run"] += 1
        reject_run_extras(args, **unsupported)

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

    def _attend_requests(
        self,
        plan: WrapperPlan,
        q: torch.Tensor,
        head_dim_v: int,
        keys_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request i's queries q[qo_indptr[i]:qo_indptr[i + 1]] against keys_of(i) = (k, v) [kv_i, Hk, D],
        under plan's custom mask where one was planned -> (out fp32 [nnz_q, Hq, Dv], natural lse [nnz_q, Hq])."""
        qo = plan.qo_indptr
        packed = self._buffers.get("custom_mask") if plan.mask_indptr is not None else None
        out = q.new_zeros(q.shape[0], q.shape[1], head_dim_v, dtype=torch.float32)
        lse = q.new_full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float32)
        for i in range(len(qo) - 1):
            kb, vb = keys_of(i)
            mask = self._mask_for(plan, i, qo[i + 1] - qo[i], kb.shape[0], packed)
            out[qo[i] : qo[i + 1]], lse[qo[i] : qo[i + 1]] = self._attend(
                plan, q[qo[i] : qo[i + 1]], kb, vb, mask, plan.causal
            )
        return out, lse

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


class PagedWrapper(ReferenceWrapper):
    """A wrapper over a paged KV cache: reads each request's keys through indptr / indices / last_page_len."""

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

    @staticmethod
    def _page_buffers(
        indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """plan()'s page layout tensors by the names run() reads them under (see _store)."""
        return {
            "paged_kv_indptr": indptr,
            "paged_kv_indices": indices,
            "paged_kv_last_page_len": last_page_len,
        }

    @staticmethod
    def _page_fields(
        indptr: tuple[int, ...], indices: tuple[int, ...], last: tuple[int, ...], page_size: int
    ) -> dict[str, Any]:
        """The WrapperPlan fields of a page layout read by read_paged_layout."""
        return dict(
            kv_indptr=indptr, kv_indices=indices[: indptr[-1]], last_page_len=last, page_size=page_size
        )

    def _attend_paged(
        self, plan: WrapperPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's queries against its own pages -> (out fp32, lse fp32), as _attend_requests."""
        return self._attend_requests(
            plan, q, v_cache.shape[-1], lambda i: self._paged_kv(k_cache, v_cache, plan, i)
        )

    def _check_paged_run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        window_left: int | None,
        **also_unchanged: tuple[int, ...],
    ) -> tuple[WrapperPlan, torch.Tensor, torch.Tensor]:
        """(plan, k_cache, v_cache as NHD) after run()'s checks: dtypes, heads, page size, and the planned
        page layout (plus `also_unchanged`) still in the buffers run() reads."""
        k_cache, v_cache = unpack_paged_kv_cache(paged_kv_cache, self._kv_layout)
        plan = self._check_run(q, k_cache, window_left)
        if k_cache.shape[1] != plan.page_size:
            raise KernelContractError(
                f"the cache's page_size {k_cache.shape[1]} differs from plan's {plan.page_size}"
            )
        batch, n_indices = len(plan.last_page_len), plan.kv_indptr[-1]
        self._check_unchanged(
            plan,
            **also_unchanged,
            kv_indptr=tuple(self._read("paged_kv_indptr", batch + 1)),
            kv_indices=tuple(self._read("paged_kv_indices", n_indices)[:n_indices]),
            last_page_len=tuple(self._read("paged_kv_last_page_len", batch)),
        )
        return plan, k_cache, v_cache


def read_paged_layout(
    indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """plan()'s page layout on the host, checked: (indptr, indices, last_page_len) as tuples of ints."""
    layout = tuple(indptr.tolist()), tuple(indices.tolist()), tuple(last_page_len.tolist())
    check_paged_layout(layout[0], len(layout[1]), layout[2], page_size)
    return layout


def check_paged_layout(indptr: Sequence[int], indices_len: int, last: Sequence[int], page_size: int) -> None:
    if len(last) != len(indptr) - 1:
        raise KernelContractError(f"last_page_len has {len(last)} entries for {len(indptr) - 1} requests")
    if indptr[-1] > indices_len:
        raise KernelContractError(f"indptr[-1]={indptr[-1]} exceeds the {indices_len} page indices")
    for i in range(len(last)):
        if indptr[i + 1] > indptr[i] and not 1 <= last[i] <= page_size:
            raise KernelContractError(f"last_page_len[{i}]={last[i]} must be in [1, page_size={page_size}]")


def reject_jit(jit_args: list[Any] | None) -> None:
    if jit_args is not None:
        raise KernelContractError(
            "the reference wrappers run the default attention variant only (jit_args given)"
        )


def reject_pos_encoding(pos_encoding_mode: str) -> None:
    if pos_encoding_mode != "NONE":
        raise KernelContractError(
            f"the reference wrappers do not apply position encodings (pos_encoding_mode={pos_encoding_mode!r})"
        )


def reject_run_extras(args: tuple[Any, ...], **values: Any) -> None:
    if args:
        raise KernelContractError("the reference wrappers take no extra positional run() arguments")
    for name, value in values.items():
        if value is not None:
            raise KernelContractError(f"the reference wrappers do not implement {name}")


# ---------------------------------------------------------------------------------------------------
