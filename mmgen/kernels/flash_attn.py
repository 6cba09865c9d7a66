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

FA3's scheduler metadata lives in `mmgen.kernels.scheduler_metadata`. Callers reach kernels through a
provider object (`mmgen.kernels.fa_providers`), so the same code runs on the references (CPU) and on
FA3 / FA4 / FA2 (GPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmgen.kernels.contract import (
    KernelContractError,
    cu_bounds,
    reject_unsupported,
    require_int32,
    window_bounds,
)
from mmgen.kernels.scheduler_metadata import check_scheduler_metadata, get_scheduler_metadata
from mmgen.kernels.varlen import pack_padded_rows

__all__ = [
    "CacheLayout",
    "KernelContractError",
    "append_new_kv",
    "attend_one",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
    "gather_paged",
]


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


def gather_paged(cache: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """First `length` tokens of one sequence from a paged cache [num_pages, page_size, H, D] -> [length, H, D]."""
    page_size = cache.shape[1]
    pages = page_row[: math.ceil(length / page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


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


# ---------------------------------------------------------------------------------------------------
# flash_attn_varlen_func / flash_attn_func


def _varlen_keys(
    k: torch.Tensor,
    v: torch.Tensor,
    batch: int,
    cu_seqlens_k: torch.Tensor | None,
    seqused_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each request's (keys, values) of a flash_attn_varlen_func call: gathered through page_table
    (seqused_k keys each), or k/v[cu_seqlens_k[b] :] (seqused_k[b] keys, else the cu length)."""
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
        for b, (k0, k1) in enumerate(cu_bounds(cu_seqlens_k)):
            end = k0 + used_k[b] if used_k is not None else k1
            keys.append((k[k0:end], v[k0:end]))
    return keys


def _check_max_seqlens(
    q_ranges: Sequence[tuple[int, int]],
    keys: Sequence[tuple[torch.Tensor, torch.Tensor]],
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> None:
    """max_seqlen_q/k, when given, must bound every request: kernels size their grids from them."""
    longest_q = max((q1 - q0 for q0, q1 in q_ranges), default=0)
    longest_k = max((kb.shape[0] for kb, _ in keys), default=0)
    if max_seqlen_q is not None and longest_q > max_seqlen_q:
        raise KernelContractError(f"max_seqlen_q={max_seqlen_q} but a request has {longest_q} queries")
    if max_seqlen_k is not None and longest_k > max_seqlen_k:
        raise KernelContractError(f"max_seqlen_k={max_seqlen_k} but a request has {longest_k} keys")


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
    reject_unsupported(qv=qv, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    reject_unsupported(attention_chunk=attention_chunk, learnable_sink=learnable_sink)
    if cu_seqlens_q is None:
        raise KernelContractError(
            "flash_attn_varlen_func needs cu_seqlens_q (use flash_attn_func for [B, S, H, D])"
        )
    batch = cu_seqlens_q.numel() - 1
    require_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    require_int32("cu_seqlens_k", cu_seqlens_k, (batch + 1,))
    require_int32("seqused_q", seqused_q, (batch,))
    require_int32("seqused_k", seqused_k, (batch,))
    require_int32("page_table", page_table)
    q_ranges = cu_bounds(cu_seqlens_q)
    if seqused_q is not None:
        q_ranges = [(q0, q0 + u) for (q0, _), u in zip(q_ranges, seqused_q.tolist(), strict=True)]
    keys = _varlen_keys(k, v, batch, cu_seqlens_k, seqused_k, page_table)
    _check_max_seqlens(q_ranges, keys, max_seqlen_q, max_seqlen_k)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _attend_rows(
        q,
        q_ranges,
        keys,
        head_dim_v=v.shape[-1],
        scale=scale,
        causal=causal,
        window=window_bounds(window_size),
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
    rows = pack_padded_rows(q, k, v)
    out, lse = flash_attn_varlen_func(
        rows.q,
        rows.k,
        rows.v,
        **rows.keywords(),
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=True,
    )
    if return_lse or return_attn_probs:
        return rows.rows(out), rows.lse_rows(lse)
    return rows.rows(out)


# ---------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (FA3)


@dataclass(frozen=True)
class CacheLayout:
    """Where the keys of each batch row live in a flash_attn_with_kvcache call."""

    paged: bool
    page_size: int
    cache_rows: tuple[int, ...]  # contiguous cache: the cache row of each batch row
    starts: tuple[int, ...]  # cache_leftpad (first logical key)
    ends: tuple[int, ...]  # cache_seqlens (end of the cached keys, before appending)


def append_new_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: CacheLayout,
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


def _query_rows(
    q: torch.Tensor, cu_seqlens_q: torch.Tensor | None, max_seqlen_q: int | None
) -> tuple[torch.Tensor, list[tuple[int, int]], int]:
    """(packed q [total_q, Hq, D], each batch row's rows in it, max_seqlen_q): varlen q by cu_seqlens_q,
    where max_seqlen_q must bound every request; else q [B, Sq, Hq, D], Sq rows each."""
    if cu_seqlens_q is None:
        batch, seq_q = q.shape[:2]
        q_ranges = [(b * seq_q, (b + 1) * seq_q) for b in range(batch)]
        return q.reshape(batch * seq_q, *q.shape[2:]), q_ranges, seq_q
    batch = cu_seqlens_q.numel() - 1
    require_int32("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    q_ranges = cu_bounds(cu_seqlens_q)
    if max_seqlen_q is None:
        raise KernelContractError("max_seqlen_q must be provided if cu_seqlens_q is provided")
    longest_q = max((q1 - q0 for q0, q1 in q_ranges), default=0)
    if longest_q > max_seqlen_q:
        raise KernelContractError(f"max_seqlen_q={max_seqlen_q} but a request has {longest_q} queries")
    return q, q_ranges, max_seqlen_q


def _cache_rows(
    k_cache: torch.Tensor,
    batch: int,
    page_table: torch.Tensor | None,
    cache_batch_idx: torch.Tensor | None,
    cache_seqlens: int | torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
) -> tuple[CacheLayout, int]:
    """Where each batch row's keys live, and how many positions a row holds (its capacity): paged through
    page_table, or a contiguous cache row (cache_batch_idx[b], default b)."""
    paged = page_table is not None
    if paged:
        require_int32("page_table", page_table)
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
        require_int32("cache_batch_idx", cache_batch_idx, (batch,))
        cache_rows = tuple(cache_batch_idx.tolist()) if cache_batch_idx is not None else tuple(range(batch))
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=k_cache.device)
    require_int32("cache_seqlens", cache_seqlens, (batch,))
    require_int32("cache_leftpad", cache_leftpad, (batch,))
    ends = tuple(cache_seqlens.tolist()) if cache_seqlens is not None else (capacity,) * batch
    starts = tuple(cache_leftpad.tolist()) if cache_leftpad is not None else (0,) * batch
    return CacheLayout(paged, page_size, cache_rows, starts, ends), capacity


def _new_tokens(
    k: torch.Tensor | None, v: torch.Tensor | None, cu_seqlens_k_new: torch.Tensor | None, batch: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each batch row's new (keys, values): k/v [B, S_new, Hk, D], or packed [total_new, Hk, D] by
    cu_seqlens_k_new; [] without new tokens."""
    if k is None:
        return []
    if cu_seqlens_k_new is not None:
        require_int32("cu_seqlens_k_new", cu_seqlens_k_new, (batch + 1,))
        return [(k[a:z], v[a:z]) for a, z in cu_bounds(cu_seqlens_k_new)]
    return [(k[b], v[b]) for b in range(batch)]


def _key_ends(
    layout: CacheLayout,
    new: Sequence[tuple[torch.Tensor, torch.Tensor]],
    capacity: int,
    page_table: torch.Tensor | None,
    num_pages: int,
) -> list[int]:
    """Each batch row's logical key end once its new tokens are appended; the cache must hold it."""
    batch = len(layout.ends)
    new_lens = [kb.shape[0] for kb, _ in new] or [0] * batch
    key_ends = [layout.ends[b] + new_lens[b] for b in range(batch)]
    for b in range(batch):
        if layout.paged:
            _check_page_row(page_table, b, key_ends[b], num_pages, layout.page_size)
        elif key_ends[b] > capacity:
            raise KernelContractError(
                f"batch row {b} needs {key_ends[b]} cache positions but the cache rows hold {capacity}"
            )
    return key_ends


def _check_call_metadata(
    scheduler_metadata: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: CacheLayout,
    key_ends: Sequence[int],
    new: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_seqlen_q: int,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k_new: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    causal: bool,
    window_size: Sequence[int | None],
    attention_chunk: int,
    softcap: float,
    num_splits: int,
    pack_gqa: bool | None,
) -> None:
    """scheduler_metadata must be what get_scheduler_metadata gives for exactly this call."""
    # max_seqlen_k(_new) 0: they are only bounds, checked against the longest row below.
    expected = get_scheduler_metadata(
        len(key_ends),
        max_seqlen_q,
        0,
        q.shape[-2],
        k_cache.shape[-2],
        q.shape[-1],
        torch.tensor(layout.ends, dtype=torch.int32),
        headdim_v=v_cache.shape[-1],
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new,
        cache_leftpad=cache_leftpad,
        page_size=layout.page_size,
        causal=causal,
        window_size=window_size,
        attention_chunk=attention_chunk,
        has_softcap=softcap > 0,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
    )
    longest_k = max((end - start for end, start in zip(key_ends, layout.starts, strict=True)), default=0)
    longest_new = max((kb.shape[0] for kb, _ in new), default=0)
    check_scheduler_metadata(scheduler_metadata, expected, longest_k, longest_new)


def _append_and_read(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new: Sequence[tuple[torch.Tensor, torch.Tensor]],
    layout: CacheLayout,
    page_table: torch.Tensor | None,
    key_ends: Sequence[int],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write the new tokens into the cache (in place, as FA3 does), then each batch row's (keys, values):
    logical positions [starts[b], key_ends[b])."""
    if new:
        append_new_kv(k_cache, v_cache, new, layout, page_table)
    keys = []
    for b, end in enumerate(key_ends):
        if layout.paged:
            kb = gather_paged(k_cache, page_table[b], end)
            vb = gather_paged(v_cache, page_table[b], end)
        else:
            kb, vb = k_cache[layout.cache_rows[b], :end], v_cache[layout.cache_rows[b], :end]
        keys.append((kb[layout.starts[b] :], vb[layout.starts[b] :]))
    return keys


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
    reject_unsupported(qv=qv, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_seqlens=rotary_seqlens)
    reject_unsupported(
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, attention_chunk=attention_chunk
    )
    if (k is None) != (v is None):
        raise KernelContractError("pass both k and v new tokens, or neither")
    q_packed, q_ranges, max_seqlen_q = _query_rows(q, cu_seqlens_q, max_seqlen_q)
    batch = len(q_ranges)
    layout, capacity = _cache_rows(k_cache, batch, page_table, cache_batch_idx, cache_seqlens, cache_leftpad)
    new = _new_tokens(k, v, cu_seqlens_k_new, batch)
    key_ends = _key_ends(layout, new, capacity, page_table, k_cache.shape[0])
    if scheduler_metadata is not None:
        _check_call_metadata(
            scheduler_metadata,
            q,
            k_cache,
            v_cache,
            layout,
            key_ends,
            new,
            max_seqlen_q=max_seqlen_q,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k_new=cu_seqlens_k_new,
            cache_leftpad=cache_leftpad,
            causal=causal,
            window_size=window_size,
            attention_chunk=attention_chunk,
            softcap=softcap,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
        )
    keys = _append_and_read(k_cache, v_cache, new, layout, page_table, key_ends)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _attend_rows(
        q_packed,
        q_ranges,
        keys,
        head_dim_v=v_cache.shape[-1],
        scale=scale,
        causal=causal,
        window=window_bounds(window_size),
        softcap=softcap,
    )
    out = out.to(q.dtype)
    if cu_seqlens_q is None:
        out = out.reshape(batch, max_seqlen_q, *out.shape[1:])
        lse = lse.reshape(lse.shape[0], batch, max_seqlen_q).transpose(0, 1)
    return (out, lse) if return_softmax_lse else out
