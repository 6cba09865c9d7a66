"""Sequence-parallel attention: Ulysses (all-to-all seq <-> heads around any impl), Ring, and both.

`SequenceParallelAttention(inner, layout)` is an AttentionImpl. Metadata of the sharded
self-attention site (ShardedSelfAttention) makes it exchange; any other metadata (cross-attention
to the replicated text) goes straight to `inner`: each rank's query shard attends the full text.

Ulysses (group of u ranks): q, k, v [B, s, H, D] -> one all-to-all for the three -> [B, u * s, H / u, D]
each (the whole group's tokens, 1/u of the heads) -> the unchanged `inner` call -> all-to-all back.
Ring (group of r ranks, after Ulysses when both): each rank keeps its queries and passes its key/value
block around the ring; partial outputs of every block are merged by their log-sum-exp. The ring needs
an LSE from the kernel: the FlashAttention provider of `inner` when it has one, else the exact
pure-torch reference (mmgen.kernels.flash_attn); each block is a varlen call over the padded rows
(mmgen.kernels.varlen).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.kernels.fa_providers import FlashAttentionProvider, ReferenceFlashAttention
from mmgen.kernels.varlen import pack_padded_rows
from mmgen.parallel.collective import Collective, run_now
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.shard_metadata import ShardedSelfAttention


class SequenceParallelAttention:
    """Wraps an AttentionImpl for a sequence sharded over layout's SP group (see the module docstring)."""

    def __init__(self, inner: AttentionImpl, layout: ParallelLayout) -> None:
        self.inner = inner
        self.layout = layout
        # What runs the sharded self-attention: `inner` under Ulysses; the ring calls an LSE kernel.
        ring = layout.ring_degree > 1
        self.name = "flash" if ring else inner.name
        self.provider = lse_kernel(inner).name if ring else inner.provider

    def __repr__(self) -> str:
        return f"SequenceParallelAttention({self.inner!r}, {self.layout.describe()})"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q, k, v [B, local, H, D] (this rank's shard) -> [B, local, H, D]; other sites: inner(q, k, v)."""
        if not isinstance(meta, ShardedSelfAttention):
            return self.inner(q, k, v, meta, scale=scale)
        layout = self.layout
        layout.check_heads(q.shape[2])
        ulysses = layout.ulysses_degree
        if ulysses > 1:
            q, k, v = qkv_to_heads(q, k, v, layout.ulysses_group, ulysses)
        if layout.ring_degree == 1:
            out = self.inner(q, k, v, meta.gathered, scale=scale)
        else:
            out = ring_attention(q, k, v, meta, layout, lse_kernel(self.inner, q), scale)
        if ulysses > 1:
            out = heads_to_seq(out, layout.ulysses_group, ulysses)
        return out


def lse_kernel(inner: AttentionImpl, q: torch.Tensor | None = None) -> FlashAttentionProvider:
    """The kernel the ring uses with `inner`: its FlashAttention provider, else the torch reference.

    With q on CUDA the reference is refused: a per-row torch loop is correct but far too slow.
    """
    kernel = getattr(inner, "kernel", None)
    kernel = kernel if isinstance(kernel, FlashAttentionProvider) else ReferenceFlashAttention()
    if q is not None and q.is_cuda and not kernel.on_gpu:
        raise ValidationError(
            "ring attention on CUDA needs a FlashAttention provider that returns the LSE "
            f"(backend flash:fa3, flash:fa4 or flash:fa2); {inner.name}:{inner.provider} has none"
        )
    return kernel


def self_attention_provider(inner: AttentionImpl, layout: ParallelLayout) -> str:
    """What runs the self-attention site under `layout`, for results: 'sdpa:sdpa ulysses2', 'flash:reference ring2'."""
    if layout.sp_degree == 1:
        return f"{inner.name}:{inner.provider}"
    wrapped = SequenceParallelAttention(inner, layout)
    parts = [f"ulysses{layout.ulysses_degree}"] * (layout.ulysses_degree > 1)
    parts += [f"ring{layout.ring_degree}"] * (layout.ring_degree > 1)
    return f"{wrapped.name}:{wrapped.provider} {' x '.join(parts)}"


def qkv_to_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: object,
    degree: int,
    collective: Collective = run_now,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, s, H, D] on each of `degree` ranks -> each [B, degree * s, H / degree, D] (rank i:
    head group i), by ONE all-to-all for the three.

    The send buffer [degree, B, s, 3, H / degree, D] holds, per destination (its head group), each
    token's q, k and v side by side; the received one [source, B, s, 3, H / degree, D] is the whole
    group's tokens of this rank's heads. With B = 1 (Qwen-Image-2.1's packed rows; Wan under CFG
    parallel) q, k and v are views of it with no copy: row stride 3 * H / degree * D, head stride D,
    unit last stride, which FA3, FA4, FA2, SDPA and the torch references read in place (cuDNN's
    "packed QKV" layout). With B > 1 the (source, s) rows of a sample are not one stride apart, so one
    copy of the three together orders them (what one copy per tensor did before). A caller that keeps
    k or v past this call copies them out, else the whole buffer (q too) stays alive. `collective`
    runs the all-to-all (mmgen.parallel.collective: now, or as a seam of a graph capture).
    """
    if not (q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype):
        raise ValueError(
            f"qkv_to_heads takes q, k, v of one shape and dtype, got {tuple(q.shape)} {q.dtype}, "
            f"{tuple(k.shape)} {k.dtype}, {tuple(v.shape)} {v.dtype}"
        )
    batch, local, heads, dim = q.shape
    part = heads // degree
    send = q.new_empty(degree, batch, local, 3, part, dim)
    for index, x in enumerate((q, k, v)):  # [B, s, H, D] -> [head group, B, s, H / degree, D]
        send[:, :, :, index].copy_(x.unflatten(2, (degree, part)).permute(2, 0, 1, 3, 4))
    received = torch.empty_like(send)  # [source rank, B, s, 3, H / degree, D]
    collective(lambda: dist.all_to_all_single(received, send, group=group))
    rows = received.transpose(0, 1).reshape(batch, degree * local, 3, part, dim)  # a view when B = 1
    return rows[:, :, 0], rows[:, :, 1], rows[:, :, 2]


def heads_to_seq(
    x: torch.Tensor, group: object, degree: int, collective: Collective = run_now
) -> torch.Tensor:
    """The way back from qkv_to_heads: [B, degree * s, H / degree, D] -> [B, s, H, D].

    With B = 1 and a contiguous x (an attention output) the send buffer is x itself; the received
    [head group, B, s, H / degree, D] is copied once into token order (what to_out reads).
    """
    batch, total, part, dim = x.shape
    local = total // degree
    # No copy where B = 1 and x is contiguous (the transposed dimension has size 1).
    send = x.reshape(batch, degree, local, part, dim).transpose(0, 1).contiguous()
    received = torch.empty_like(send)  # [head group, B, s, H / degree, D]
    collective(lambda: dist.all_to_all_single(received, send, group=group))
    return received.permute(1, 2, 0, 3, 4).reshape(batch, local, degree * part, dim)


def attention_with_lse(
    kernel: FlashAttentionProvider,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid_keys: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Sq, H, D] attends the first valid_keys of k/v [B, Sk, H, D] -> (out fp32 [B, Sq, H, D], lse fp32 [B, Sq, H, 1])."""
    rows = pack_padded_rows(q, k, v, valid_keys, gather_keys=not kernel.has_seqused_k)
    out, lse = kernel.flash_attn_varlen_func(
        rows.q, rows.k, rows.v, **rows.keywords(), softmax_scale=scale, causal=False, return_lse=True
    )  # lse [H, B * Sq], natural log
    return rows.rows(out).float(), rows.lse_rows(lse).float().transpose(1, 2).unsqueeze(-1)


def merge_partial(
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
    accumulate: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint key sets by their LSE (-inf = no keys).

    Accumulates in `accumulate`: float64 for fp32 inputs (elementwise, cheap next to the blocks'
    attention) keeps the ring's reordered sum within fp32 rounding of the one-kernel result;
    bf16/fp16 runs pass float32.
    """
    block_out, block_lse = block_out.to(accumulate), block_lse.to(accumulate)
    if out is None:
        return block_out, block_lse
    merged = torch.logaddexp(lse, block_lse)
    # Rows where both are -inf stay -inf with zero output (exp(-inf - -inf) would be NaN).
    safe = torch.where(torch.isinf(merged), torch.zeros_like(merged), merged)
    return out * torch.exp(lse - safe) + block_out * torch.exp(block_lse - safe), merged


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: ShardedSelfAttention,
    layout: ParallelLayout,
    kernel: FlashAttentionProvider,
    scale: float | None,
) -> torch.Tensor:
    """q, k, v [B, L, H, D]: ring rank i holds padded positions [i * L, (i + 1) * L) -> out [B, L, H, D].

    Key/value blocks go around the ring (one send + one receive per step, overlapped with the
    block's attention); blocks past the valid tokens are skipped, partial blocks use key lengths.
    """
    degree, rank, group = layout.ring_degree, layout.ring_rank, layout.ring_group
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block = q.shape[1]
    send_to = dist.get_global_rank(group, (rank + 1) % degree)
    receive_from = dist.get_global_rank(group, (rank - 1) % degree)
    kv = torch.stack([k, v]).contiguous()
    accumulate = torch.float64 if q.dtype == torch.float32 else torch.float32
    out = lse = None
    for step in range(degree):
        pending = []
        if step + 1 < degree:
            incoming = torch.empty_like(kv)
            ops = [
                dist.P2POp(dist.isend, kv, send_to, group=group),
                dist.P2POp(dist.irecv, incoming, receive_from, group=group),
            ]
            pending = dist.batch_isend_irecv(ops)
        source = (rank - step) % degree
        valid = meta.valid_keys(source * block, block)
        if valid:
            block_out, block_lse = attention_with_lse(kernel, q, kv[0], kv[1], valid, scale)
            out, lse = merge_partial(out, lse, block_out, block_lse, accumulate)
        for request in pending:
            request.wait()
        if pending:
            kv = incoming
    if out is None:  # only a ring rank holding nothing but padding can see no key at all
        return torch.zeros_like(q)
    return out.to(q.dtype)
