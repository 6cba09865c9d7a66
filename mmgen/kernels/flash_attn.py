"""Pure-torch reference of flash-attn's `flash_attn_varlen_func` contract (FA3/FA4 signature).

Used as the CPU path of the diffusion FlashAttentionImpl and as the test oracle for the GPU kernels.
Computes in fp32, returns q's dtype. Semantics follow flash-attn:
- q: [total_q, Hq, D] packed by cu_seqlens_q; k, v: [total_k, Hk, D] packed by cu_seqlens_k, or, with
  page_table, paged caches [num_pages, page_size, Hk, D] read through page_table [B, max_pages].
- seqused_k [B] (optional) overrides the per-sequence key count.
- causal is aligned bottom-right: query i of a sequence with Lq queries and Lk keys sees keys
  j <= i + Lk - Lq. window_size=(left, right), None or -1 = unbounded, also bottom-right aligned.
- softcap > 0: scores = softcap * tanh(scores / softcap), applied after scaling.
- return_lse: also returns the natural-log LSE [Hq, total_q] (float32).
GQA: Hq must be a multiple of Hk; query head h reads kv head h // (Hq // Hk).
"""

from __future__ import annotations

import math

import torch


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
    """Dense attention of one sequence in fp32. q [Lq, Hq, D], k/v [Lk, Hk, D] -> (out [Lq, Hq, D], lse [Hq, Lq]).

    mask: optional bool [Lq, Lk] (True = may attend), combined with causal/window. Rows with no
    visible key give output 0 and lse -inf.
    """
    lq, hq, _ = q.shape
    lk, hk, _ = k.shape
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


def _window(window_size: tuple[int | None, int | None] | None) -> tuple[int | None, int | None]:
    if window_size is None:
        return None, None
    left, right = window_size
    return (None if left is None or left < 0 else left), (None if right is None or right < 0 else right)


def gather_paged(cache: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """First `length` tokens of one sequence from a paged cache [num_pages, page_size, H, D]."""
    page_size = cache.shape[1]
    pages = page_row[: math.ceil(length / page_size)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_k: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = (None, None),
    softcap: float = 0.0,
    return_lse: bool = False,
    **_unused_tuning: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of FA's varlen forward; see the module docstring for the contract."""
    total_q, hq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else d**-0.5
    left, right = _window(window_size)
    if cu_seqlens_q is None:
        raise ValueError("flash_attn_varlen_func reference needs cu_seqlens_q")
    batch = cu_seqlens_q.numel() - 1
    out = torch.zeros(total_q, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((hq, total_q), float("-inf"), dtype=torch.float32, device=q.device)
    cq = cu_seqlens_q.tolist()
    ck = cu_seqlens_k.tolist() if cu_seqlens_k is not None else None
    used = seqused_k.tolist() if seqused_k is not None else None
    for b in range(batch):
        q0, q1 = cq[b], cq[b + 1]
        if q1 == q0:
            continue
        if page_table is not None:
            if used is None:
                raise ValueError("a paged call needs seqused_k")
            kb = gather_paged(k, page_table[b], int(used[b]))
            vb = gather_paged(v, page_table[b], int(used[b]))
        else:
            if ck is None:
                raise ValueError("a non-paged call needs cu_seqlens_k")
            k0 = ck[b]
            k1 = k0 + int(used[b]) if used is not None else ck[b + 1]
            kb, vb = k[k0:k1], v[k0:k1]
        ob, lb = attend_one(
            q[q0:q1],
            kb,
            vb,
            scale=scale,
            causal=causal,
            window_left=left,
            window_right=right,
            softcap=softcap,
        )
        out[q0:q1] = ob
        lse[:, q0:q1] = lb
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] | None = (None, None),
    softcap: float = 0.0,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of FA's dense forward: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> [B, Sq, Hq, D]."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
    res = flash_attn_varlen_func(
        q.reshape(b * sq, hq, d),
        k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]),
        cu_q,
        cu_k,
        sq,
        sk,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        return_lse=return_lse,
    )
    if return_lse:
        out, lse = res
        return out.reshape(b, sq, hq, -1), lse.reshape(hq, b, sq).transpose(0, 1)
    return res.reshape(b, sq, hq, -1)
