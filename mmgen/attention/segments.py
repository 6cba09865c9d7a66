"""Segment attention: each run of queries reads one contiguous range of keys, as explicit varlen metadata.

A structured mask that is a union of "these queries see keys [start, start + count)" rows is one
varlen call with no mask at all: packed queries q [Tq, H, D] are cut into segments by cu_seqlens_q,
and segment s reads the keys k[cu_seqlens_k[s] : cu_seqlens_k[s] + seqused_k[s]] of the packed key
buffer k [Tk, Hk, D], without causality inside the segment. Segments may share keys (their key ranges
overlap), so cu_seqlens_k here holds each segment's key *start* (non-decreasing, not a cumulative
sum of the seqused_k); the kernels (FA3, FA4, mmgen's reference) read a segment's keys from its start
for seqused_k[s] keys and never look at cu_seqlens_k[s + 1] when seqused_k is given.

Block-causal attention (Qwen-Image-2.1) is such a union: a causal text token i sees keys [0, i],
an image block [s, e) sees keys [0, e); so is the cached step, where the target image's queries read
their sample's cached prefix and their own keys. Both go through `segment_attention`:

- FlashAttentionImpl: one `flash_attn_varlen_func` call (non-causal, seqused_k); a provider without
  seqused_k (FA2) gets each segment's keys gathered (keys shared by segments are copied).
- SDPAImpl: the same metadata as a boolean [Tq, Tk] mask (`allowed_keys`, made once per metadata) and one SDPA call: the
  CPU path and the dense reference (its cost is Tq * Tk; it is not the fast path).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmgen.attention.impls import AttentionImpl, FlashAttentionImpl, SDPAImpl
from mmgen.errors import ValidationError


@dataclass(frozen=True)
class SegmentMetadata:
    """Segments of packed queries and the key range each reads (the module docstring).

    cu_seqlens_q: int32 [S + 1], segment s's queries are rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]).
    cu_seqlens_k: int32 [S + 1], segment s's first key; the last entry is the key buffer's length.
    seqused_k: int32 [S], how many keys segment s reads from its first.
    max_seqlen_q / max_seqlen_k: the longest segment's queries / keys (kernels size grids by them).
    total_q / total_k: the packed query and key counts, host ints (checking them costs no device sync).
    Built once per model call on the host and moved to the device once; never mutated.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    total_q: int
    total_k: int

    @staticmethod
    def build(
        query_lengths: Sequence[int],
        key_starts: Sequence[int],
        key_counts: Sequence[int],
        total_k: int,
        *,
        device: torch.device | str | None = None,
    ) -> SegmentMetadata:
        """From host ints: segment s has query_lengths[s] queries (consecutive in that order) reading
        keys [key_starts[s], key_starts[s] + key_counts[s]) of a buffer of total_k keys."""
        if not (len(query_lengths) == len(key_starts) == len(key_counts)) or not query_lengths:
            raise ValidationError(
                f"segments need equal, non-empty lists: {len(query_lengths)} query lengths, "
                f"{len(key_starts)} key starts, {len(key_counts)} key counts"
            )
        for start, count in zip(key_starts, key_counts, strict=True):
            if start < 0 or count < 0 or start + count > total_k:
                raise ValidationError(f"segment keys [{start}, {start + count}) lie outside [0, {total_k})")
        if list(key_starts) != sorted(key_starts):
            raise ValidationError(f"segment key starts must be non-decreasing, got {list(key_starts)}")
        cu_q = torch.zeros(len(query_lengths) + 1, dtype=torch.int32)
        cu_q[1:] = torch.cumsum(torch.tensor(query_lengths, dtype=torch.int32), 0)
        cu_k = torch.tensor([*key_starts, total_k], dtype=torch.int32)
        used = torch.tensor(key_counts, dtype=torch.int32)
        return SegmentMetadata(
            cu_q.to(device),
            cu_k.to(device),
            used.to(device),
            max(query_lengths),
            max(key_counts),
            sum(query_lengths),
            total_k,
        )

    @functools.cached_property
    def allowed_keys(self) -> torch.Tensor:
        """bool [Tq, Tk]: True where query row i may read key j (the dense form of the same metadata),
        made when first read (the SDPA path, every layer of the call shares it)."""
        lengths_q = (self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]).long()
        starts = torch.repeat_interleave(self.cu_seqlens_k[:-1].long(), lengths_q)
        ends = starts + torch.repeat_interleave(self.seqused_k.long(), lengths_q)
        keys = torch.arange(self.total_k, device=starts.device)[None, :]
        return (keys >= starts[:, None]) & (keys < ends[:, None])


def segment_attention(
    impl: AttentionImpl,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SegmentMetadata,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """q [Tq, H, D], k/v [Tk, Hk, D] packed -> [Tq, H, D] in q's dtype, each segment over its keys only."""
    if q.shape[0] != meta.total_q or k.shape[0] != meta.total_k:
        raise ValidationError(
            f"segment attention got {q.shape[0]} queries / {k.shape[0]} keys; the metadata describes "
            f"{meta.total_q} / {meta.total_k}"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if isinstance(impl, FlashAttentionImpl):
        return _flash_segments(impl, q, k, v, meta, scale)
    if isinstance(impl, SDPAImpl):
        return _sdpa_segments(q, k, v, meta, scale)
    raise ValidationError(
        f"attention impl {impl!r} has no segment (block-causal) path; use the 'flash' or 'sdpa' backend"
    )


def _flash_segments(
    impl: FlashAttentionImpl,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: SegmentMetadata,
    scale: float,
) -> torch.Tensor:
    kernel = impl.kernel
    if kernel.has_seqused_k:
        return kernel.flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            seqused_k=meta.seqused_k,
            softmax_scale=scale,
            causal=False,
        )
    # No seqused_k (FA2): copy each segment's keys into a packed buffer of their own (one host sync).
    starts, counts = meta.cu_seqlens_k[:-1].tolist(), meta.seqused_k.tolist()
    index = torch.cat([torch.arange(s, s + n, device=k.device) for s, n in zip(starts, counts, strict=True)])
    cu_k = torch.zeros_like(meta.cu_seqlens_q)
    cu_k[1:] = torch.cumsum(meta.seqused_k, 0)
    return kernel.flash_attn_varlen_func(
        q,
        k.index_select(0, index),
        v.index_select(0, index),
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=False,
    )


def _sdpa_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: SegmentMetadata, scale: float
) -> torch.Tensor:
    mask = meta.allowed_keys
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )[0].transpose(0, 1)
    # A query row with no key is NaN in SDPA; the varlen contract gives zeros.
    has_keys = mask.any(dim=1)[:, None, None]
    return torch.where(has_keys, out, torch.zeros((), dtype=out.dtype, device=out.device))
