"""Sequence sharding: a sample's tokens split across the SP group, padded to a multiple of its degree.

The padded token count is sp_degree * local; rank r holds tokens [r * local, (r + 1) * local). The
padding (at the end of the sequence, on the last ranks) is kept out of attention through key lengths
in the metadata, never by changing the user's size; its query rows are computed and then dropped
when the shards are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata, DiTAttention
from mmgen.errors import ValidationError
from mmgen.parallel.attention import SequenceParallelAttention
from mmgen.parallel.collective import Collective, run_now
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.shard_metadata import ShardedSelfAttention


@dataclass(frozen=True)
class SequenceShard:
    """How one model call's token sequence [B, tokens, ...] is split over layout's SP group."""

    layout: ParallelLayout
    tokens: int
    local: int

    @staticmethod
    def plan(tokens: int, layout: ParallelLayout) -> SequenceShard:
        degree = layout.sp_degree
        return SequenceShard(layout, tokens, -(-tokens // degree))

    @property
    def padded(self) -> int:
        return self.local * self.layout.sp_degree

    def metadata(self, batch: int, device: torch.device) -> ShardedSelfAttention:
        """The self-attention metadata of this shard (key lengths only when the sequence was padded)."""
        gathered = AttentionMetadata()
        if self.padded != self.tokens:
            # Every row holds `tokens` keys: the offsets and their maximum are known here, so no
            # device tensor is read back (from_lengths' max() would sync once per model call).
            offsets = torch.arange(
                0, (batch + 1) * self.tokens, self.tokens, dtype=torch.int32, device=device
            )
            gathered = AttentionMetadata(cu_seqlens_k=offsets, max_seqlen_k=self.tokens)
        return ShardedSelfAttention(tokens=self.tokens, local=self.local, gathered=gathered)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, tokens, ...] -> this rank's [B, local, ...] (zero rows past the end of the sequence)."""
        if x.shape[1] != self.tokens:
            raise ValidationError(
                f"sequence shard: expected {self.tokens} tokens, got shape {tuple(x.shape)}"
            )
        pad = self.padded - self.tokens
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        start = self.layout.sp_rank * self.local
        return x[:, start : start + self.local]

    def gather(self, x: torch.Tensor, collective: Collective = run_now) -> torch.Tensor:
        """This rank's [B, local, ...] -> the whole [B, tokens, ...] on every rank of the SP group;
        `collective` runs the all-gather (mmgen.parallel.collective)."""
        parts = [torch.empty_like(x) for _ in range(self.layout.sp_degree)]
        send = x.contiguous()
        collective(lambda: dist.all_gather(parts, send, group=self.layout.sp_group))
        return torch.cat(parts, dim=1)[:, : self.tokens]


def shard_dit_inputs(
    layout: ParallelLayout,
    heads: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    metadata: DiTAttention,
    attention: AttentionImpl,
) -> tuple[SequenceShard, torch.Tensor, tuple[torch.Tensor, torch.Tensor], DiTAttention, AttentionImpl]:
    """A DiT call's inputs for this rank: token shard, RoPE rows, metadata and the SP attention wrapper.

    x [B, S, dim] -> [B, local, dim]; rope (cos, sin) [1, S, 1, head_dim] -> [1, local, 1, head_dim];
    self-attention metadata (must be dense: video tokens have no per-row lengths) -> ShardedSelfAttention;
    cross-attention metadata unchanged (the text is replicated on every rank).
    """
    layout.check_heads(heads)
    if not metadata.self_attn.is_dense:
        raise ValidationError("sequence parallel: self-attention metadata must be dense (video tokens)")
    shard = SequenceShard.plan(x.shape[1], layout)
    sharded = replace(metadata, self_attn=shard.metadata(x.shape[0], x.device))
    rope_local = (shard.split(rope[0]), shard.split(rope[1]))
    return shard, shard.split(x), rope_local, sharded, SequenceParallelAttention(attention, layout)
