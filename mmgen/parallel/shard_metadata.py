"""The self-attention metadata of a sequence-sharded call: what the SP attention wrapper reads.

Its own module below both users: `sequence` builds it (SequenceShard.metadata) and `attention` reads it
(SequenceParallelAttention), and `sequence` wraps attention in turn.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmgen.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class ShardedSelfAttention(AttentionMetadata):
    """Self-attention metadata of a sequence split over the SP group (this rank's shard, local tokens each).

    tokens: valid tokens of the whole sequence (the rest of sp_degree * local is padding).
    gathered: the metadata of the full padded sequence (the Ulysses call): dense when nothing is
    padded, else key lengths = tokens per row. Built once per model call, read by every layer.
    """

    tokens: int = 0
    local: int = 0
    gathered: AttentionMetadata = AttentionMetadata()

    def valid_keys(self, start: int, length: int) -> int:
        """How many of the padded sequence's positions [start, start + length) are real tokens."""
        return max(0, min(length, self.tokens - start))
