"""Pure-torch references of the FlashAttention kernel contracts mmgen calls (the CPU path and the test oracle).

Matched against the sources of the GPU versions: fa3-fwd 0.0.3 (`fa3_fwd_interface`, the same Python API
as flash-attention's `hopper/flash_attn_interface.py`) and flash-attn-4 4.0.0b36 (`flash_attn/cute/interface.py`).
Every function computes in fp32 and returns q's dtype; LSE is float32 and natural-log (FlashInfer's is base 2).

Semantics shared by all entry points:
- GQA: Hq must be a multiple of Hk; query head h reads kv head h // (Hq // Hk).
- causal is aligned bottom-right: query i of a sequence with Lq queries and Lk keys sees keys
  j <= i + Lk - Lq. window_size=(left, right), -1 or None = unbounded, also bottom-right aligned:
  keys j in [i + Lk - Lq - left, i + Lk - Lq + right], so a causal window of `left` covers left + 1 keys.
- softcap > 0: scores = softcap * tanh(scores / softcap), applied after the softmax scale.
- A query that sees no key gets output 0 and LSE -inf (what the kernels write for an empty row).
- Packed varlen tensors are [total, H, D] with int32 cu_seqlens [B + 1]; LSE of a varlen call is
  [Hq, total_q], of a batched call [B, Hq, Sq] (both FA3 and FA4).

Arguments the references do not implement (rotary, qv, fp8 descales, attention_chunk) raise
KernelContractError instead of being dropped. Calls that would make a real kernel read outside what the
caller set up (a page table narrower than the keys, max_seqlen_q below a request's length, scheduler
metadata computed for another batch or window) raise KernelContractError too: that is how CPU tests
catch backend bugs that would silently corrupt GPU results.

Backends call kernels through a provider object (`load_flash_attention_provider`), so the same backend
code runs on the references (CPU) and on FA3 / FA4 (GPU); see `FlashAttentionProvider`.
"""

from __future__ import annotations

import collections
import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mmgen.errors import MmgenError, ValidationError


class KernelContractError(MmgenError, ValueError):
    """A kernel call breaks the kernel's contract (shapes, dtypes, stale metadata, unsupported argument)."""


class KernelUnavailableError(MmgenError):
    """The requested kernel library is not installed or cannot run on this machine."""


# ---------------------------------------------------------------------------------------------------
# Dense per-sequence attention and small helpers


def attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of one sequence in fp32. q [Lq, Hq, D], k/v [Lk, Hk, D] -> (out [Lq, Hq, Dv], lse [Hq, Lq]).

    mask: optional bool [Lq, Lk] (True = may attend), combined with causal/window. Rows with no
    visible key give output 0 and lse -inf.
    """
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
    if hq % hk:
        raise KernelContractError(f"query heads {hq} are not a multiple of key/value heads {hk}")
    group = hq // hk
    qf = q.float()
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    qi = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right aligned query position
    kj = torch.arange(lk, device=q.device)[None, :]
    if causal:
        visible &= kj <= qi
    if window_left is not None and window_left >= 0:
        visible &= kj >= qi - window_left
    if window_right is not None and window_right >= 0:
        visible &= kj <= qi + window_right
    if mask is not None:
        visible &= mask
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Lq]
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out, lse


def _window(window_size: Sequence[int | None] | None) -> tuple[int | None, int | None]:
    """(left, right) with None for unbounded; -1 and None both mean unbounded."""
    if window_size is None:
        return None, None
    left, right = window_size
    return (None if left is None or left < 0 else left), (None if right is None or right < 0 else right)


def gather_paged(cache: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """First `length` tokens of one sequence from a paged cache [num_pages, page_size, H, D] -> [length, H, D]."""
    page_size = cache.shape[1]
    pages = page_row[: math.ceil(length / page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _require_int32(name: str, t: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
    if t is None:
        return
    if t.dtype != torch.int32:
        raise KernelContractError(f"{name} must be int32 (the kernels read it as int32), got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelContractError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _reject(**unsupported: Any) -> None:
    """Raise for any argument set to something other than its 'off' value (None, False, 0)."""
    for name, value in unsupported.items():
        is_off = value is None or (isinstance(value, (bool, int, float)) and not value)
        if not is_off:
            shown = f"a tensor {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise KernelContractError(f"the mmgen kernel adapters do not implement {name} (got {shown})")


def _check_page_row(page_table: torch.Tensor, row: int, length: int, num_pages: int, page_size: int) -> None:
    """The pages the kernel reads for `length` tokens of batch row `row` must exist in the table and the pool."""
    need = math.ceil(length / page_size)
    if need > page_table.shape[1]:
        raise KernelContractError(
            f"page_table row {row} has {page_table.shape[1]} columns but {length} keys at page_size "
            f"{page_size} need {need}: the kernel would read past the row"
        )
    if need:
        used = page_table[row, :need]
        lo, hi = int(used.min()), int(used.max())
        if lo < 0 or hi >= num_pages:
            raise KernelContractError(
                f"page_table row {row} names pages {lo}..{hi} outside the cache's {num_pages} pages"
            )


def _attend_rows(
    q: torch.Tensor,
    q_ranges: Sequence[tuple[int, int]],
    keys: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    head_dim_v: int,
    scale: float,
    causal: bool,
    window: tuple[int | None, int | None],
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-request attention over packed q [total_q, Hq, D] -> (out fp32 [total_q, Hq, Dv], lse [Hq, total_q])."""
    total_q, hq, _ = q.shape
    out = torch.zeros(total_q, hq, head_dim_v, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    for (q0, q1), (kb, vb) in zip(q_ranges, keys, strict=True):
        if q1 == q0:
            continue
        ob, lb = attend_one(
            q[q0:q1],
            kb,
            vb,
            scale=scale,
            causal=causal,
            window_left=window[0],
            window_right=window[1],
            softcap=softcap,
        )
        out[q0:q1] = ob
        lse[:, q0:q1] = lb
    return out, lse


def _bounds_of(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1)]


# ---------------------------------------------------------------------------------------------------
# flash_attn_varlen_func / flash_attn_func


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    page_table: torch.Tensor | None = None,
    window_size: Sequence[int | None] | None = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    qv: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    attention_chunk: int = 0,
    learnable_sink: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention. q [total_q, Hq, D]; k/v [total_k, Hk, D] by cu_seqlens_k, or paged -> [total_q, Hq, Dv].

    The positional order is FA3's (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    seqused_q, seqused_k, softmax_scale, causal); call with keywords past v, because FA4 puts qv fourth.
    Paged (FA4): page_table [B, max_pages] int32 with k/v [num_pages, page_size, Hk, D] and seqused_k [B]
    giving each request's key count (cu_seqlens_k must be None). Non-paged: keys of request b are
    k[cu_seqlens_k[b] : cu_seqlens_k[b] + (seqused_k[b] if given else the cu length)]. seqused_q [B]
    limits the queries computed per request (the rest stay 0). max_seqlen_q/k, when given, must bound
    every request (kernels size their grids from them). return_lse (FA4 name) or return_attn_probs
    (FA3 name) returns (out, lse [Hq, total_q] natural log); otherwise just out.
    """
    _reject(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    _reject(attention_chunk=attention_chunk, learnable_sink=learnable_sink)
    if cu_seqlens_q is None:
        raise KernelContractError(
            "flash_attn_varlen_func needs cu_seqlens_q (use flash_attn_func for [B, S, H, D])"
        )
    batch = cu_seqlens_q.numel() - 1
    _require_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    _require_int32("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    _require_int32("seqused_q", seqused_q, (batch,))
    _require_int32("seqused_k", seqused_k, (batch,))
    _require_int32("page_table", page_table)
    q_ranges = _bounds_of(cu_seqlens_q)
    if seqused_q is not None:
        q_ranges = [(q0, q0 + u) for (q0, _), u in zip(q_ranges, seqused_q.tolist(), strict=True)]
    used_k = seqused_k.tolist() if seqused_k is not None else None
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    if page_table is not None:
        if cu_seqlens_k is not None:
            raise KernelContractError("page_table is not supported with cu_seqlens_k (FA4 asserts this)")
        if used_k is None:
            raise KernelContractError("a paged call needs seqused_k (each request's key count)")
        if page_table.shape[0] != batch:
            raise KernelContractError(f"page_table has {page_table.shape[0]} rows for a batch of {batch}")
        num_pages, page_size = k.shape[:2]
        for b in range(batch):
            _check_page_row(page_table, b, used_k[b], num_pages, page_size)
            keys.append(
                (gather_paged(k, page_table[b], used_k[b]), gather_paged(v, page_table[b], used_k[b]))
            )
    else:
        if cu_seqlens_k is None:
            raise KernelContractError("a non-paged call needs cu_seqlens_k")
        for b, (k0, k1) in enumerate(_bounds_of(cu_seqlens_k)):
            end = k0 + used_k[b] if used_k is not None else k1
            keys.append((k[k0:end], v[k0:end]))
    longest_q = max((q1 - q0 for q0, q1 in q_ranges), default=0)
    longest_k = max((kb.shape[0] for kb, _ in keys), default=0)
    if max_seqlen_q is not None and longest_q > max_seqlen_q:
        raise KernelContractError(f"max_seqlen_q={max_seqlen_q} but a request has {longest_q} queries")
    if max_seqlen_k is not None and longest_k > max_seqlen_k:
        raise KernelContractError(f"max_seqlen_k={max_seqlen_k} but a request has {longest_k} keys")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _attend_rows(
        q,
        q_ranges,
        keys,
        head_dim_v=v.shape[-1],
        scale=scale,
        causal=causal,
        window=_window(window_size),
        softcap=softcap,
    )
    out = out.to(q.dtype)
    return (out, lse) if (return_lse or return_attn_probs) else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    *,
    window_size: Sequence[int | None] | None = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    return_attn_probs: bool = False,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Dense attention: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> [B, Sq, Hq, Dv] (+ lse [B, Hq, Sq] if asked)."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    out, lse = flash_attn_varlen_func(
        q.reshape(b * sq, hq, d),
        k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=sq,
        max_seqlen_k=sk,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=True,
    )
    out = out.reshape(b, sq, hq, -1)
    if return_lse or return_attn_probs:
        return out, lse.reshape(hq, b, sq).transpose(0, 1)
    return out


# ---------------------------------------------------------------------------------------------------
# FA3 scheduler metadata: an int32 tensor recording what it was computed for

_SCHEDULER_MAGIC = 0x4D4D5343  # "MMSC": marks tensors made by get_scheduler_metadata below
_SCHEDULER_HEADER = (
    "batch_size",
    "max_seqlen_q",
    "max_seqlen_k",
    "num_heads_q",
    "num_heads_kv",
    "headdim",
    "headdim_v",
    "page_size",
    "causal",
    "window_left",
    "window_right",
    "attention_chunk",
    "has_softcap",
    "num_splits",
    "pack_gqa",
    "max_seqlen_k_new",
    "has_cu_seqlens_q",
    "has_cu_seqlens_k_new",
    "has_cache_leftpad",
)


@dataclass(frozen=True)
class SchedulerMetadataInfo:
    """What one scheduler-metadata tensor was computed for (the reference's metadata encodes exactly this).

    Tensor layout (int32, 1-D): [magic, the 19 header fields in `_SCHEDULER_HEADER` order,
    cache_seqlens (batch_size), cu_seqlens_q (batch_size + 1, zeros if none), cache_leftpad
    (batch_size, zeros if none)]. window is canonical: -1 = unbounded, right = 0 when causal, and
    causal is set exactly when (left, right) == (-1, 0), as FA3 canonicalizes it. page_size 0 means a
    contiguous cache; pack_gqa -1 means None (heuristic).
    """

    batch_size: int
    max_seqlen_q: int
    max_seqlen_k: int
    num_heads_q: int
    num_heads_kv: int
    headdim: int
    headdim_v: int
    page_size: int
    causal: bool
    window_left: int
    window_right: int
    attention_chunk: int
    has_softcap: bool
    num_splits: int
    pack_gqa: int
    max_seqlen_k_new: int
    has_cu_seqlens_q: bool
    has_cu_seqlens_k_new: bool
    has_cache_leftpad: bool
    cache_seqlens: tuple[int, ...]
    cu_seqlens_q: tuple[int, ...]
    cache_leftpad: tuple[int, ...]

    def to_tensor(self, device: torch.device | str) -> torch.Tensor:
        """Encode as the opaque int32 metadata tensor."""
        header = [int(getattr(self, name)) for name in _SCHEDULER_HEADER]
        values = [_SCHEDULER_MAGIC, *header, *self.cache_seqlens, *self.cu_seqlens_q, *self.cache_leftpad]
        return torch.tensor(values, dtype=torch.int32, device=device)

    @classmethod
    def from_tensor(cls, metadata: torch.Tensor) -> SchedulerMetadataInfo:
        """Decode a tensor made by get_scheduler_metadata; KernelContractError for anything else."""
        values = metadata.tolist() if metadata.dim() == 1 and metadata.dtype == torch.int32 else []
        n_header = len(_SCHEDULER_HEADER)
        if len(values) < 1 + n_header or values[0] != _SCHEDULER_MAGIC:
            raise KernelContractError(
                "scheduler_metadata was not made by mmgen.kernels.flash_attn.get_scheduler_metadata "
                f"(dtype {metadata.dtype}, shape {list(metadata.shape)})"
            )
        fields = dict(zip(_SCHEDULER_HEADER, values[1 : 1 + n_header], strict=True))
        batch = fields["batch_size"]
        rest = values[1 + n_header :]
        if len(rest) != 3 * batch + 1:
            raise KernelContractError(
                f"scheduler_metadata holds {len(rest)} values after its header, not {3 * batch + 1}"
            )
        for flag in (
            "causal",
            "has_softcap",
            "has_cu_seqlens_q",
            "has_cu_seqlens_k_new",
            "has_cache_leftpad",
        ):
            fields[flag] = bool(fields[flag])
        return cls(
            **fields,
            cache_seqlens=tuple(rest[:batch]),
            cu_seqlens_q=tuple(rest[batch : 2 * batch + 1]),
            cache_leftpad=tuple(rest[2 * batch + 1 :]),
        )


def _canonical_window(causal: bool, window_size: Sequence[int | None] | None) -> tuple[bool, int, int]:
    """FA3's canonical (causal, left, right): -1 unbounded, causal <=> (-1, 0)."""
    left, right = _window(window_size)
    left = -1 if left is None else left
    right = -1 if right is None else right
    if causal:
        right = 0
    return (left < 0 and right == 0), left, right


def get_scheduler_metadata(
    batch_size: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    num_heads_q: int,
    num_heads_kv: int,
    headdim: int,
    cache_seqlens: torch.Tensor,
    qkv_dtype: torch.dtype = torch.bfloat16,
    headdim_v: int | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_size: int | None = None,
    max_seqlen_k_new: int = 0,
    causal: bool = False,
    window_size: Sequence[int | None] = (-1, -1),
    attention_chunk: int = 0,
    has_softcap: bool = False,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> torch.Tensor:
    """FA3 signature. cache_seqlens int32 [B] -> opaque int32 metadata (see SchedulerMetadataInfo).

    The reference flash_attn_with_kvcache validates a metadata tensor against its call and raises when
    it was computed for another batch size, lengths, heads, page size, window, softcap or split count.
    """
    _require_int32("cache_seqlens", cache_seqlens, (batch_size,))
    _require_int32("cu_seqlens_q", cu_seqlens_q, (batch_size + 1,))
    _require_int32("cu_seqlens_k_new", cu_seqlens_k_new, (batch_size + 1,))
    _require_int32("cache_leftpad", cache_leftpad, (batch_size,))
    is_causal, left, right = _canonical_window(causal, window_size)
    info = SchedulerMetadataInfo(
        batch_size=batch_size,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        num_heads_q=num_heads_q,
        num_heads_kv=num_heads_kv,
        headdim=headdim,
        headdim_v=headdim if headdim_v is None else headdim_v,
        page_size=page_size or 0,
        causal=is_causal,
        window_left=left,
        window_right=right,
        attention_chunk=attention_chunk,
        has_softcap=bool(has_softcap),
        num_splits=num_splits,
        pack_gqa=-1 if pack_gqa is None else int(pack_gqa),
        max_seqlen_k_new=max_seqlen_k_new,
        has_cu_seqlens_q=cu_seqlens_q is not None,
        has_cu_seqlens_k_new=cu_seqlens_k_new is not None,
        has_cache_leftpad=cache_leftpad is not None,
        cache_seqlens=tuple(cache_seqlens.tolist()),
        cu_seqlens_q=tuple(cu_seqlens_q.tolist()) if cu_seqlens_q is not None else (0,) * (batch_size + 1),
        cache_leftpad=tuple(cache_leftpad.tolist()) if cache_leftpad is not None else (0,) * batch_size,
    )
    return info.to_tensor(cache_seqlens.device)


def describe_scheduler_metadata(metadata: torch.Tensor) -> SchedulerMetadataInfo:
    """What a reference scheduler-metadata tensor was computed for (for tests and error messages)."""
    return SchedulerMetadataInfo.from_tensor(metadata)


def _check_scheduler_metadata(
    metadata: torch.Tensor, expected: SchedulerMetadataInfo, longest_k: int, longest_new: int
) -> None:
    got = SchedulerMetadataInfo.from_tensor(metadata)
    exact = [name for name in _SCHEDULER_HEADER if name not in ("max_seqlen_k", "max_seqlen_k_new")]
    exact += ["cache_seqlens", "cu_seqlens_q", "cache_leftpad"]
    wrong = [
        f"{n}: metadata {getattr(got, n)} vs call {getattr(expected, n)}"
        for n in exact
        if getattr(got, n) != getattr(expected, n)
    ]
    if got.max_seqlen_k < longest_k:
        wrong.append(f"max_seqlen_k: metadata {got.max_seqlen_k} < longest key count {longest_k}")
    if got.max_seqlen_k_new < longest_new:
        wrong.append(
            f"max_seqlen_k_new: metadata {got.max_seqlen_k_new} < longest appended count {longest_new}"
        )
    if wrong:
        raise KernelContractError(
            "scheduler_metadata was computed for a different call (compute it once per batch for each "
            "distinct layer kind, e.g. one for sliding-window layers and one for global ones): "
            + "; ".join(wrong)
        )


# ---------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (FA3)


@dataclass(frozen=True)
class _CacheLayout:
    """Where the keys of each batch row live in a flash_attn_with_kvcache call."""

    paged: bool
    page_size: int
    cache_rows: tuple[int, ...]  # contiguous cache: the cache row of each batch row
    starts: tuple[int, ...]  # cache_leftpad (first logical key)
    ends: tuple[int, ...]  # cache_seqlens (end of the cached keys, before appending)


def _append_new_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: _CacheLayout,
    page_table: torch.Tensor | None,
) -> None:
    """Write each row's new keys/values at logical positions ends[b].. of its cache, in place (FA3 append)."""
    for b, (kb, vb) in enumerate(new):
        n = kb.shape[0]
        if n == 0:
            continue
        pos = torch.arange(layout.ends[b], layout.ends[b] + n, device=k_cache.device)
        if layout.paged:
            pages = page_table[b].long()[pos // layout.page_size]
            k_cache[pages, pos % layout.page_size] = kb.to(k_cache.dtype)
            v_cache[pages, pos % layout.page_size] = vb.to(v_cache.dtype)
        else:
            k_cache[layout.cache_rows[b], pos] = kb.to(k_cache.dtype)
            v_cache[layout.cache_rows[b], pos] = vb.to(v_cache.dtype)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: Sequence[int | None] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FA3 signature. q [B, Sq, Hq, D] or varlen [total_q, Hq, D] (cu_seqlens_q) -> out like q, Dv last.

    Cache: paged [num_pages, page_size, Hk, D] read through page_table [B, max_pages] int32, or
    contiguous [B_cache, S_cache, Hk, D] (row cache_batch_idx[b], default b). Row b's keys are logical
    positions [cache_leftpad[b], cache_seqlens[b] + new_b): cache_seqlens int32 [B] (or an int) is the
    cached length before this call's new tokens. k/v new tokens ([B, S_new, Hk, D], or
    [total_new, Hk, D] with cu_seqlens_k_new) are written into the cache in place at cache_seqlens[b]
    first, as FA3 does. causal/window are aligned bottom-right to each row's key count.
    scheduler_metadata (from get_scheduler_metadata) is validated against this call.
    Returns out, or (out, softmax_lse) with lse [B, Hq, Sq] / [Hq, total_q] when return_softmax_lse;
    the real FA3 also returns its split accumulators there, which the providers drop.
    """
    _reject(qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens)
    _reject(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk)
    if (k is None) != (v is None):
        raise KernelContractError("pass both k and v new tokens, or neither")
    varlen = cu_seqlens_q is not None
    if varlen:
        batch = cu_seqlens_q.numel() - 1
        _require_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
        q_ranges = _bounds_of(cu_seqlens_q)
        if max_seqlen_q is None:
            raise KernelContractError("max_seqlen_q must be provided if cu_seqlens_q is provided")
        longest_q = max((q1 - q0 for q0, q1 in q_ranges), default=0)
        if longest_q > max_seqlen_q:
            raise KernelContractError(f"max_seqlen_q={max_seqlen_q} but a request has {longest_q} queries")
        q_packed = q
    else:
        batch, seq_q = q.shape[:2]
        max_seqlen_q = seq_q
        q_ranges = [(b * seq_q, (b + 1) * seq_q) for b in range(batch)]
        q_packed = q.reshape(batch * seq_q, *q.shape[2:])
    paged = page_table is not None
    if paged:
        _require_int32("page_table", page_table)
        if page_table.shape[0] != batch:
            raise KernelContractError(f"page_table has {page_table.shape[0]} rows for a batch of {batch}")
        if cache_batch_idx is not None:
            raise KernelContractError("cache_batch_idx is for contiguous caches, not with page_table")
        page_size = k_cache.shape[1]
        capacity = page_table.shape[1] * page_size
        cache_rows = tuple(range(batch))
    else:
        page_size = 0
        capacity = k_cache.shape[1]
        _require_int32("cache_batch_idx", cache_batch_idx, (batch,))
        cache_rows = tuple(cache_batch_idx.tolist()) if cache_batch_idx is not None else tuple(range(batch))
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    _require_int32("cache_seqlens", cache_seqlens, (batch,))
    _require_int32("cache_leftpad", cache_leftpad, (batch,))
    ends = tuple(cache_seqlens.tolist()) if cache_seqlens is not None else (capacity,) * batch
    starts = tuple(cache_leftpad.tolist()) if cache_leftpad is not None else (0,) * batch
    layout = _CacheLayout(paged, page_size, cache_rows, starts, ends)

    new: list[tuple[torch.Tensor, torch.Tensor]] = []
    if k is not None:
        if cu_seqlens_k_new is not None:
            _require_int32("cu_seqlens_k_new", cu_seqlens_k_new, (batch + 1,))
            new = [(k[a:z], v[a:z]) for a, z in _bounds_of(cu_seqlens_k_new)]
        else:
            new = [(k[b], v[b]) for b in range(batch)]
    new_lens = [kb.shape[0] for kb, _ in new] or [0] * batch
    key_ends = [ends[b] + new_lens[b] for b in range(batch)]
    for b in range(batch):
        if paged:
            _check_page_row(page_table, b, key_ends[b], k_cache.shape[0], page_size)
        elif key_ends[b] > capacity:
            raise KernelContractError(
                f"batch row {b} needs {key_ends[b]} cache positions but the cache rows hold {capacity}"
            )

    if scheduler_metadata is not None:
        is_causal, left, right = _canonical_window(causal, window_size)
        expected = SchedulerMetadataInfo(
            batch_size=batch,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=0,
            num_heads_q=q.shape[-2],
            num_heads_kv=k_cache.shape[-2],
            headdim=q.shape[-1],
            headdim_v=v_cache.shape[-1],
            page_size=page_size,
            causal=is_causal,
            window_left=left,
            window_right=right,
            attention_chunk=attention_chunk,
            has_softcap=softcap > 0,
            num_splits=num_splits,
            pack_gqa=-1 if pack_gqa is None else int(pack_gqa),
            max_seqlen_k_new=0,
            has_cu_seqlens_q=varlen,
            has_cu_seqlens_k_new=cu_seqlens_k_new is not None,
            has_cache_leftpad=cache_leftpad is not None,
            cache_seqlens=ends,
            cu_seqlens_q=tuple(cu_seqlens_q.tolist()) if varlen else (0,) * (batch + 1),
            cache_leftpad=starts if cache_leftpad is not None else (0,) * batch,
        )
        longest_k = max((key_ends[b] - starts[b] for b in range(batch)), default=0)
        _check_scheduler_metadata(scheduler_metadata, expected, longest_k, max(new_lens, default=0))

    if new:
        _append_new_kv(k_cache, v_cache, new, layout, page_table)
    keys = []
    for b in range(batch):
        if paged:
            kb = gather_paged(k_cache, page_table[b], key_ends[b])
            vb = gather_paged(v_cache, page_table[b], key_ends[b])
        else:
            kb, vb = k_cache[cache_rows[b], : key_ends[b]], v_cache[cache_rows[b], : key_ends[b]]
        keys.append((kb[starts[b] :], vb[starts[b] :]))
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _attend_rows(
        q_packed,
        q_ranges,
        keys,
        head_dim_v=v_cache.shape[-1],
        scale=scale,
        causal=causal,
        window=_window(window_size),
        softcap=softcap,
    )
    out = out.to(q.dtype)
    if not varlen:
        out = out.reshape(batch, max_seqlen_q, *out.shape[1:])
        lse = lse.reshape(lse.shape[0], batch, max_seqlen_q).transpose(0, 1)
    return (out, lse) if return_softmax_lse else out


# ---------------------------------------------------------------------------------------------------
# Providers: one object per library with the same method names, so backends run unchanged on each


class FlashAttentionProvider(Protocol):
    """What a FlashAttention backend calls. Every implementation counts its calls in `calls`.

    Methods (keywords past the positional ones; the same names and meanings as the reference functions):
    - flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, <FA3 keywords>) -> out, or
      (out, softmax_lse) when return_softmax_lse=True (always a pair: FA3's extra accumulators dropped).
    - flash_attn_varlen_func(q, k, v, *, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None,
      max_seqlen_k=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
      window_size=(-1, -1), softcap=0.0, return_lse=False) -> out, or (out, lse [Hq, total_q]).
    - get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
      headdim, cache_seqlens, *, <FA3 keywords>) -> an opaque tensor to pass as scheduler_metadata,
      or None where the library needs none (FA4).
    Windows use -1 for unbounded on every provider (the FA4 adapter converts to FA4's None).
    """

    name: str
    calls: collections.Counter
    supports_paged_kv: bool
    supports_window: bool

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor | None: ...


class ReferenceFlashAttention:
    """The pure-torch references behind the provider interface; `calls` counts each method's calls."""

    name = "reference"
    supports_paged_kv = True
    supports_window = True

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See the module function `flash_attn_with_kvcache`; keywords only past v."""
        self.calls["flash_attn_with_kvcache"] += 1
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)

    def flash_attn_varlen_func(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See the module function `flash_attn_varlen_func`; keywords only past v."""
        self.calls["flash_attn_varlen_func"] += 1
        return flash_attn_varlen_func(q, k, v, **kwargs)

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """See the module function `get_scheduler_metadata`."""
        self.calls["get_scheduler_metadata"] += 1
        return get_scheduler_metadata(
            batch_size,
            max_seqlen_q,
            max_seqlen_k,
            num_heads_q,
            num_heads_kv,
            headdim,
            cache_seqlens,
            **kwargs,
        )


def _uses_window(window_size: Sequence[int | None] | None) -> bool:
    left, right = _window(window_size)
    return left is not None or right is not None


class FA3FlashAttention:
    """Adapter over an FA3 module (`flash_attn_interface`, or `fa3_fwd_interface` from fa3-fwd 0.0.3).

    Build flags (fa3-fwd 0.0.3 has no paged KV and no local window) come from the module's config; a
    call needing a missing feature raises KernelContractError before reaching the library.
    """

    name = "fa3"

    def __init__(self, module: Any, build_flags: dict[str, bool]) -> None:
        self.module = module
        self.calls: collections.Counter = collections.Counter()
        self.supports_paged_kv = not build_flags.get("FLASHATTENTION_DISABLE_PAGEDKV", False)
        self.supports_window = not build_flags.get("FLASHATTENTION_DISABLE_LOCAL", False)

    def _check(self, page_table: torch.Tensor | None, window_size: Sequence[int | None] | None) -> None:
        module = self.module.__name__
        if page_table is not None and not self.supports_paged_kv:
            raise KernelContractError(f"{module} was built without paged KV (FLASHATTENTION_DISABLE_PAGEDKV)")
        if _uses_window(window_size) and not self.supports_window:
            raise KernelContractError(
                f"{module} was built without sliding windows (FLASHATTENTION_DISABLE_LOCAL)"
            )

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA3's flash_attn_with_kvcache; returns out or (out, softmax_lse)."""
        self.calls["flash_attn_with_kvcache"] += 1
        self._check(kwargs.get("page_table"), kwargs.get("window_size"))
        res = self.module.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kwargs)
        return (res[0], res[1]) if kwargs.get("return_softmax_lse") else res

    def flash_attn_varlen_func(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        seqused_k: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: Sequence[int | None] = (-1, -1),
        softcap: float = 0.0,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Varlen attention; a paged call goes through FA3's kvcache entry (its varlen one has no page_table)."""
        self.calls["flash_attn_varlen_func"] += 1
        self._check(page_table, window_size)
        window = tuple(-1 if w is None else w for w in window_size)
        common = dict(softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap)
        if page_table is not None:
            res = self.module.flash_attn_with_kvcache(
                q,
                k,
                v,
                cache_seqlens=seqused_k,
                page_table=page_table,
                cu_seqlens_q=cu_seqlens_q,
                max_seqlen_q=max_seqlen_q,
                return_softmax_lse=return_lse,
                **common,
            )
        else:
            res = self.module.flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                seqused_k=seqused_k,
                return_attn_probs=return_lse,
                **common,
            )
        return (res[0], res[1]) if return_lse else res

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> torch.Tensor:
        """FA3's get_scheduler_metadata (a tensor for flash_attn_with_kvcache's scheduler_metadata)."""
        self.calls["get_scheduler_metadata"] += 1
        return self.module.get_scheduler_metadata(
            batch_size,
            max_seqlen_q,
            max_seqlen_k,
            num_heads_q,
            num_heads_kv,
            headdim,
            cache_seqlens,
            **kwargs,
        )


class FA4FlashAttention:
    """Adapter over flash-attn-4's `flash_attn.cute.flash_attn_varlen_func` (4.0.0b36, page_table + seqused_k).

    FA4 has no kvcache entry: flash_attn_with_kvcache maps onto its varlen function (cache_seqlens ->
    seqused_k; new k/v are written into the caller's cache first by the same torch code the reference
    uses). It runs with num_splits=1 (FA4 has no split-KV on sm90), where FA4 needs no scheduler
    metadata: get_scheduler_metadata returns None (still counted) and flash_attn_with_kvcache accepts
    only None. FA4 returns (out, lse) from every call; the adapter returns out alone unless asked.
    """

    name = "fa4"
    supports_paged_kv = True
    supports_window = True

    def __init__(self, varlen_func: Any) -> None:
        self.varlen_func = varlen_func
        self.calls: collections.Counter = collections.Counter()

    def _varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        return_lse: bool,
        window_size: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # FA4 means "unbounded" only by None: a lone -1 bound would be taken literally there.
        out, lse = self.varlen_func(
            q, k, v, window_size=_window(window_size), num_splits=1, return_lse=return_lse, **kwargs
        )
        return (out, lse) if return_lse else out

    def flash_attn_varlen_func(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        seqused_k: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: Sequence[int | None] = (-1, -1),
        softcap: float = 0.0,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA4's flash_attn_varlen_func; returns out, or (out, lse [Hq, total_q]) when return_lse."""
        self.calls["flash_attn_varlen_func"] += 1
        return self._varlen(
            q,
            k,
            v,
            return_lse,
            window_size,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            seqused_k=seqused_k,
            page_table=page_table,
            softmax_scale=softmax_scale,
            causal=causal,
            softcap=softcap,
        )

    def flash_attn_with_kvcache(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
        *,
        qv: torch.Tensor | None = None,
        rotary_cos: torch.Tensor | None = None,
        rotary_sin: torch.Tensor | None = None,
        cache_seqlens: int | torch.Tensor | None = None,
        cache_batch_idx: torch.Tensor | None = None,
        cache_leftpad: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k_new: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        rotary_seqlens: torch.Tensor | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: Sequence[int | None] = (-1, -1),
        attention_chunk: int = 0,
        softcap: float = 0.0,
        rotary_interleaved: bool = True,
        scheduler_metadata: torch.Tensor | None = None,
        num_splits: int = 0,
        pack_gqa: bool | None = None,
        sm_margin: int = 0,
        return_softmax_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """FA3's flash_attn_with_kvcache contract (minus rotary, qv, fp8, leftpad), run by FA4's varlen kernel."""
        self.calls["flash_attn_with_kvcache"] += 1
        _reject(qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens)
        _reject(
            q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk
        )
        _reject(cache_leftpad=cache_leftpad, scheduler_metadata=scheduler_metadata)
        batch = cu_seqlens_q.numel() - 1 if cu_seqlens_q is not None else q.shape[0]
        paged = page_table is not None
        if isinstance(cache_seqlens, int) or cache_seqlens is None:
            full = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
            length = full if cache_seqlens is None else cache_seqlens
            cache_seqlens = torch.full((batch,), length, dtype=torch.int32, device=q.device)
        rows = (
            tuple(cache_batch_idx.tolist())
            if cache_batch_idx is not None and not paged
            else tuple(range(batch))
        )
        seqused_k = cache_seqlens
        if k is not None:
            if cu_seqlens_k_new is not None:
                new = [(k[a:z], v[a:z]) for a, z in _bounds_of(cu_seqlens_k_new)]
            else:
                new = [(k[b], v[b]) for b in range(batch)]
            ends = tuple(cache_seqlens.tolist())
            layout = _CacheLayout(paged, k_cache.shape[1] if paged else 0, rows, (0,) * batch, ends)
            _append_new_kv(k_cache, v_cache, new, layout, page_table)
            seqused_k = cache_seqlens + torch.tensor(
                [kb.shape[0] for kb, _ in new], dtype=torch.int32, device=q.device
            )
        if not paged and cache_batch_idx is not None:
            index = cache_batch_idx.long()
            k_cache, v_cache = k_cache[index], v_cache[index]
        return self._varlen(
            q,
            k_cache,
            v_cache,
            return_softmax_lse,
            window_size,
            cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=max_seqlen_q,
            seqused_k=seqused_k,
            page_table=page_table,
            softmax_scale=softmax_scale,
            causal=causal,
            softcap=softcap,
        )

    def get_scheduler_metadata(
        self,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        headdim: int,
        cache_seqlens: torch.Tensor,
        **kwargs: Any,
    ) -> None:
        """None: FA4 at num_splits=1 schedules without precomputed metadata (the call is still counted)."""
        self.calls["get_scheduler_metadata"] += 1
        return None


_PROVIDER_NAMES = ("auto", "fa3", "fa4", "reference")


def _load_fa3() -> FA3FlashAttention:
    reasons = []
    for module_name, config_name in (
        ("flash_attn_interface", "flash_attn_config"),
        ("fa3_fwd_interface", "fa3_fwd_config"),
    ):
        try:
            module = importlib.import_module(module_name)
        except (ImportError, OSError, RuntimeError) as err:
            reasons.append(f"{module_name}: {err}")
            continue
        try:
            flags = dict(importlib.import_module(config_name).CONFIG.get("build_flags", {}))
        except (ImportError, AttributeError):
            flags = {}  # builds without a config module have every feature
        return FA3FlashAttention(module, flags)
    raise KernelUnavailableError(
        "flash-attention provider 'fa3' is not installed (pip install fa3-fwd, or build flash-attention's hopper/): "
        + "; ".join(reasons)
    )


def _load_fa4() -> FA4FlashAttention:
    try:
        cute = importlib.import_module("flash_attn.cute")
        return FA4FlashAttention(cute.flash_attn_varlen_func)
    except (ImportError, OSError, RuntimeError, AttributeError) as err:
        raise KernelUnavailableError(
            f"flash-attention provider 'fa4' is not installed (pip install flash-attn-4): {err}"
        ) from err


def gpu_kernels_apply(device: torch.device | str | None, dtype: torch.dtype | None) -> bool:
    """Whether data of this device/dtype can run through real GPU attention kernels (None = unknown: yes)."""
    on_cuda = device is None or torch.device(device).type == "cuda"
    return on_cuda and (dtype is None or dtype in (torch.bfloat16, torch.float16))


def load_flash_attention_provider(
    name: str = "auto",
    *,
    paged_kv: bool = False,
    window: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> ReferenceFlashAttention | FA3FlashAttention | FA4FlashAttention:
    """The provider called `name` ("auto" | "fa3" | "fa4" | "reference").

    "auto": for data on a CUDA device in bf16/fp16 (device/dtype of the tensors it will see; None =
    not known, assume CUDA when present) the first of FA3 (on sm90) and FA4 that is installed and
    supports what is asked (paged_kv, window), else the reference: the real kernels take neither CPU
    tensors nor fp32. A named GPU provider that is missing, has no CUDA device, or lacks an
    asked-for feature raises KernelUnavailableError.
    """
    if name not in _PROVIDER_NAMES:
        raise ValidationError(
            f"unknown flash-attention provider {name!r}: expected one of {', '.join(_PROVIDER_NAMES)}"
        )
    if name == "reference":
        return ReferenceFlashAttention()
    has_cuda = torch.cuda.is_available()
    if name != "auto":
        if not has_cuda:
            raise KernelUnavailableError(
                f"flash-attention provider {name!r} needs a CUDA device; none is available"
            )
        provider = _load_fa3() if name == "fa3" else _load_fa4()
        missing = [f for f, asked, has in (("paged KV", paged_kv, provider.supports_paged_kv), ("sliding window", window, provider.supports_window)) if asked and not has]  # fmt: skip
        if missing:
            raise KernelUnavailableError(
                f"flash-attention provider {name!r} is built without {' and '.join(missing)}"
            )
        return provider
    if has_cuda and gpu_kernels_apply(device, dtype):
        candidates = (("fa3", _load_fa3), ("fa4", _load_fa4))
        for cand, loader in candidates:
            if cand == "fa3" and torch.cuda.get_device_capability()[0] != 9:
                continue
            try:
                provider = loader()
            except KernelUnavailableError:
                continue
            if (paged_kv and not provider.supports_paged_kv) or (window and not provider.supports_window):
                continue
            return provider
    return ReferenceFlashAttention()
