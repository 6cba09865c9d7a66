"""Segment attention: each run of queries reads one contiguous range of keys, as explicit varlen metadata.

A structured mask that is a union of "these queries see keys [start, start + count)" rows, or of
"these queries see their keys causally", is one or two varlen calls with no mask at all. Packed
queries q [Tq, H, D] are cut into consecutive segments; segment s has n_s queries and reads the keys
k[key_start[s] : key_start[s] + key_count[s]] of the packed key buffer k [Tk, Hk, D]:

- bidirectional: every query of the segment reads all its keys;
- causal (aligned to its last key, as FlashAttention's causal varlen): query i of n reads its first
  key_count - n + i + 1 keys, i.e. the segment's queries are the last n positions of its key range.

Segments may share keys (their key ranges overlap), so a call's cu_seqlens_k holds each segment's
key *start* (non-decreasing, not a cumulative sum of the seqused_k); the kernels (FA3, FA4, mmgen's
reference) read a segment's keys from its start for seqused_k[s] keys and never look at
cu_seqlens_k[s + 1] when seqused_k is given.

The bidirectional segments are one kernel call and the causal ones another (a kernel call is causal
or not). Where both kinds exist, each call names its segments' query rows by start (cu_seqlens_q)
and count (seqused_q), reads q in place and computes only those rows; the output is the first
call's, with the second call's rows copied in (`SegmentCall.rows`; the smaller call goes second).

Block-causal attention (Qwen-Image-2.1) is such a union: a run of text tokens is one causal segment
(token i sees keys [0, i]), an image block [s, e) one bidirectional segment reading keys [0, e); the
cached step, where the target image's queries read their sample's cached prefix and their own keys,
is bidirectional segments only. Both go through `segment_attention`:

- FlashAttentionImpl: one `flash_attn_varlen_func` call per kind (seqused_q/k); a provider without
  them (FA2) gets each call's query rows and each segment's keys gathered (shared keys are copied).
- SDPAImpl: the same metadata as a boolean [Tq, Tk] mask (`allowed_keys`, made once per metadata)
  and one SDPA call: the CPU path and the dense reference (its cost is Tq * Tk; not the fast path).
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
class SegmentCall:
    """The segments one kernel call computes: all bidirectional or all causal.

    cu_seqlens_q: int32 [S + 1], segment s's first query row; the last entry is the query buffer's length.
    seqused_q: int32 [S], segment s's query count, or None where the segments tile the rows
    (cu_seqlens_q is then the cumulative sum).
    cu_seqlens_k: int32 [S + 1], segment s's first key; the last entry is the key buffer's length.
    seqused_k: int32 [S], how many keys segment s reads from its first.
    rows: int64 [R], the query rows this call computes, where its output is copied into another's (None
    for the first call).
    max_seqlen_q / max_seqlen_k: the longest segment's queries / keys (kernels size grids by them).
    """

    cu_seqlens_q: torch.Tensor
    seqused_q: torch.Tensor | None
    cu_seqlens_k: torch.Tensor
    seqused_k: torch.Tensor
    rows: torch.Tensor | None
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool

    @property
    def query_counts(self) -> torch.Tensor:
        """int64 [S]: each segment's query count."""
        return (self.seqused_q if self.seqused_q is not None else self.cu_seqlens_q.diff()).long()

    def varlen_arguments(self) -> dict:
        """The flash_attn_varlen_func keywords of this call (past q, k, v; no softmax scale)."""
        arguments = dict(
            cu_seqlens_q=self.cu_seqlens_q,
            cu_seqlens_k=self.cu_seqlens_k,
            max_seqlen_q=self.max_seqlen_q,
            max_seqlen_k=self.max_seqlen_k,
            seqused_k=self.seqused_k,
            causal=self.causal,
        )
        if self.seqused_q is not None:
            arguments["seqused_q"] = self.seqused_q
        return arguments


def _call(
    query_starts: list[int],
    query_lengths: list[int],
    key_starts: list[int],
    key_counts: list[int],
    total_q: int,
    total_k: int,
    *,
    causal: bool,
    tiled: bool,
    first: bool,
    device: torch.device | str | None,
) -> SegmentCall:
    rows = None
    if not first:
        rows = torch.cat([torch.arange(s, s + n) for s, n in zip(query_starts, query_lengths, strict=True)])
    return SegmentCall(
        cu_seqlens_q=torch.tensor([*query_starts, total_q], dtype=torch.int32).to(device),
        seqused_q=None if tiled else torch.tensor(query_lengths, dtype=torch.int32).to(device),
        cu_seqlens_k=torch.tensor([*key_starts, total_k], dtype=torch.int32).to(device),
        seqused_k=torch.tensor(key_counts, dtype=torch.int32).to(device),
        rows=None if rows is None else rows.to(device),
        max_seqlen_q=max(query_lengths),
        max_seqlen_k=max(key_counts),
        causal=causal,
    )


@dataclass(frozen=True)
class SegmentMetadata:
    """Segments of packed queries and the key range each reads (the module docstring): one or two
    kernel calls (`calls`: the bidirectional segments, the causal ones, the larger first).

    total_q / total_k: the packed query and key counts, host ints (checking them costs no device sync);
    pairs: how many query-key pairs the segments read.
    Built once per model call on the host and moved to the device once; never mutated.
    """

    calls: tuple[SegmentCall, ...]
    total_q: int
    total_k: int
    pairs: int  # the query-key pairs the segments read (attention FLOPs = 4 * head_dim * heads * pairs)

    @staticmethod
    def build(
        query_lengths: Sequence[int],
        key_starts: Sequence[int],
        key_counts: Sequence[int],
        total_k: int,
        *,
        causal: Sequence[bool] | None = None,
        device: torch.device | str | None = None,
    ) -> SegmentMetadata:
        """From host ints: segment s has query_lengths[s] queries (consecutive in that order) reading
        keys [key_starts[s], key_starts[s] + key_counts[s]) of a buffer of total_k keys, causally where
        causal[s] (None: none is)."""
        causal = [False] * len(query_lengths) if causal is None else [bool(c) for c in causal]
        if not (len(query_lengths) == len(key_starts) == len(key_counts) == len(causal)) or not query_lengths:
            raise ValidationError(
                f"segments need equal, non-empty lists: {len(query_lengths)} query lengths, "
                f"{len(key_starts)} key starts, {len(key_counts)} key counts, {len(causal)} causal flags"
            )
        for start, count in zip(key_starts, key_counts, strict=True):
            if start < 0 or count < 0 or start + count > total_k:
                raise ValidationError(f"segment keys [{start}, {start + count}) lie outside [0, {total_k})")
        for n, count, is_causal in zip(query_lengths, key_counts, causal, strict=True):
            if n < 1 or (is_causal and count < n):
                raise ValidationError(
                    f"a segment of {n} queries reading {count} keys{' causally' if is_causal else ''}: "
                    "every segment has a query, and a causal one at least as many keys as queries"
                )
        query_starts = [0]
        for n in query_lengths[:-1]:
            query_starts.append(query_starts[-1] + n)
        total_q = sum(query_lengths)
        kinds = [[s for s in range(len(causal)) if causal[s] == kind] for kind in (False, True)]
        kinds = sorted((k for k in kinds if k), key=lambda k: -sum(query_lengths[s] for s in k))
        calls = []
        for index, segments in enumerate(kinds):
            starts = [key_starts[s] for s in segments]
            if starts != sorted(starts):
                raise ValidationError(f"segment key starts must be non-decreasing, got {starts}")
            calls.append(
                _call(
                    [query_starts[s] for s in segments],
                    [query_lengths[s] for s in segments],
                    starts,
                    [key_counts[s] for s in segments],
                    total_q,
                    total_k,
                    causal=causal[segments[0]],
                    tiled=len(kinds) == 1,
                    first=index == 0,
                    device=device,
                )
            )
        pairs = sum(
            n * count - (n * (n - 1) // 2 if is_causal else 0)
            for n, count, is_causal in zip(query_lengths, key_counts, causal, strict=True)
        )
        return SegmentMetadata(tuple(calls), total_q, total_k, pairs)

    @functools.cached_property
    def allowed_keys(self) -> torch.Tensor:
        """bool [Tq, Tk]: True where query row i may read key j (the dense form of the same metadata),
        made when first read (the SDPA path, every layer of the call shares it)."""
        device = self.calls[0].cu_seqlens_q.device
        allowed = torch.zeros(self.total_q, self.total_k, dtype=torch.bool, device=device)
        keys = torch.arange(self.total_k, device=device)[None, :]
        for call in self.calls:
            lengths = call.query_counts
            # each query's position in its segment, then its row
            offset = torch.arange(int(lengths.sum()), device=device) - torch.repeat_interleave(
                torch.cumsum(lengths, 0) - lengths, lengths
            )
            rows = torch.repeat_interleave(call.cu_seqlens_q[:-1].long(), lengths) + offset
            starts = torch.repeat_interleave(call.cu_seqlens_k[:-1].long(), lengths)
            ends = starts + torch.repeat_interleave(call.seqused_k.long(), lengths)
            if call.causal:  # query i of n reads up to its key count - n + i + 1
                ends = ends - torch.repeat_interleave(lengths, lengths) + offset + 1
            allowed[rows] = (keys >= starts[:, None]) & (keys < ends[:, None])
        return allowed


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
    out: torch.Tensor | None = None
    for call in meta.calls:
        if kernel.has_seqused_k:  # in place: each call reads q and writes its own rows only
            result = kernel.flash_attn_varlen_func(q, k, v, **call.varlen_arguments(), softmax_scale=scale)
            rows, values = call.rows, result if call.rows is None else result.index_select(0, call.rows)
        else:
            rows, values = _gathered_call(kernel, q, k, v, call, scale)
        if out is None and rows is None:
            out = values
            continue
        if out is None:
            out = torch.empty(meta.total_q, *values.shape[1:], dtype=values.dtype, device=values.device)
        out.index_copy_(0, rows, values)
    assert out is not None
    return out


def _gathered_call(
    kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: SegmentCall, scale: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """A provider without seqused_q/k (FA2): the call's query rows and each segment's keys copied into
    packed buffers of their own (one host sync). Returns (rows, their outputs); rows None = all, in order."""
    q_starts = call.cu_seqlens_q[:-1].tolist()
    lengths = call.query_counts.tolist()
    starts, counts = call.cu_seqlens_k[:-1].tolist(), call.seqused_k.tolist()
    keys = torch.cat([torch.arange(s, s + n, device=k.device) for s, n in zip(starts, counts, strict=True)])
    rows = None
    if call.seqused_q is not None:
        rows = torch.cat(
            [torch.arange(s, s + n, device=q.device) for s, n in zip(q_starts, lengths, strict=True)]
        )
    cu_q = torch.zeros_like(call.cu_seqlens_q)
    cu_q[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=q.device), 0)
    cu_k = torch.zeros_like(call.cu_seqlens_k)
    cu_k[1:] = torch.cumsum(call.seqused_k, 0)
    values = kernel.flash_attn_varlen_func(
        q if rows is None else q.index_select(0, rows),
        k.index_select(0, keys),
        v.index_select(0, keys),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=call.max_seqlen_q,
        max_seqlen_k=call.max_seqlen_k,
        softmax_scale=scale,
        causal=call.causal,
    )
    return rows, values


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
