"""Ulysses over packed rows: a varlen call's rows [T, ...] split over the Ulysses group, heads exchanged
around attention.

A packed (varlen) model holds every sample's tokens as the rows of one [T, dim] tensor and describes
attention by segment metadata over those rows (Qwen-Image-2.1's block-causal segments,
mmgen.attention.segments). Under Ulysses each rank runs the per-token work (projections, norms, RoPE,
modulation, MLP) on its own contiguous shard of the rows, all heads; one all-to-all before attention
(q, k and v together) gives every rank ALL T rows for H / u of the heads. Attention is per head, and the
segment metadata speaks only of rows, so every rank reads the very metadata one process builds: nothing
about it is sharded, re-indexed or rebuilt per rank. A second all-to-all after attention gives each rank
its rows back with every head. Key/value caches kept from the attention site hold all rows of the rank's
own heads (copied out of the exchange's buffer). Rows past T (padding to a multiple of the degree) are
projected, cut before attention and dropped when the rows are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmgen.errors import ValidationError
from mmgen.parallel.attention import heads_to_seq, qkv_to_heads
from mmgen.parallel.collective import Collective, run_now
from mmgen.parallel.layout import ParallelLayout
from mmgen.parallel.sequence import SequenceShard


@dataclass(frozen=True)
class PackedUlysses:
    """One model call's T packed rows over layout's Ulysses group (built once per call, read by every layer)."""

    layout: ParallelLayout
    shard: SequenceShard
    collective: Collective = run_now  # how the call's collectives run (mmgen.parallel.collective)

    @staticmethod
    def plan(
        rows: int, heads: int, layout: ParallelLayout, collective: Collective = run_now
    ) -> PackedUlysses:
        """T rows and H heads over layout's SP group: Ulysses only (the degree must divide H)."""
        if layout.ring_degree > 1:
            raise ValidationError(
                f"parallel: packed (segment) attention runs Ulysses only, not a ring (layout "
                f"{layout.describe()}); use --sp N with --ring 1, N dividing the {heads} attention heads"
            )
        layout.check_heads(heads)
        return PackedUlysses(layout, SequenceShard.plan(rows, layout), collective)

    @property
    def rows(self) -> int:
        return self.shard.tokens

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> this rank's rows [local, ...] (zero rows past T on the last ranks)."""
        return self.shard.split(x[None])[0]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's [local, ...] -> all rows [T, ...] on every rank of the group."""
        return self.shard.gather(x[None], self.collective)[0]

    def to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows q, k, v [local, H, D] -> all T rows of its head group [T, H / u, D] each,
        by one all-to-all: views of one received buffer (mmgen.parallel.attention.qkv_to_heads), so a
        cache keeping k/v copies them out."""
        layout = self.layout
        exchanged = qkv_to_heads(
            q[None], k[None], v[None], layout.ulysses_group, layout.ulysses_degree, self.collective
        )
        return tuple(x[0, : self.rows] for x in exchanged)

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of to_heads: [T, H / u, D] -> this rank's rows [local, H, D]."""
        layout = self.layout
        if self.shard.padded != self.rows:  # zero rows past T (F.pad copies even when it pads nothing)
            x = F.pad(x, (0, 0, 0, 0, 0, self.shard.padded - self.rows))
        return heads_to_seq(x[None], layout.ulysses_group, layout.ulysses_degree, self.collective)[0]
