"""Attention metadata for the diffusion models: a frozen value built once per model call.

An impl never mutates it. A field left None means "use the dense shape of the tensors you got":
max_seqlen_q = q.shape[1], max_seqlen_k = k.shape[1] for q, k of shape [B, S, H, D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Sequence layout of one attention site for one model call.

    cu_seqlens_q / cu_seqlens_k: int32 [B + 1] cumulative valid lengths. With a padded [B, S, H, D]
    tensor, row b's valid tokens are its first (cu[b + 1] - cu[b]) positions; the rest are padding
    that is neither attended to (keys) nor computed (queries: their output is zero).
    """

    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    @property
    def is_dense(self) -> bool:
        return self.cu_seqlens_q is None and self.cu_seqlens_k is None

    @staticmethod
    def from_lengths(lengths_q: torch.Tensor | None, lengths_k: torch.Tensor | None) -> AttentionMetadata:
        """Build varlen metadata from per-row valid lengths (int [B]); None keeps that side dense."""
        return AttentionMetadata(
            cu_seqlens_q=_cumulative(lengths_q),
            cu_seqlens_k=_cumulative(lengths_k),
            max_seqlen_q=None if lengths_q is None else int(lengths_q.max()),
            max_seqlen_k=None if lengths_k is None else int(lengths_k.max()),
        )


def _cumulative(lengths: torch.Tensor | None) -> torch.Tensor | None:
    if lengths is None:
        return None
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths.to(torch.int32), 0)
    return cu


@dataclass(frozen=True)
class DiTAttention:
    """The metadata of both attention sites of a DiT call: separate objects, never shared.

    Cross-attention keys are text tokens, whose lengths differ from the video tokens'; one shared
    object filled lazily would let a later layer inherit another site's lengths.
    """

    self_attn: AttentionMetadata
    cross_attn: AttentionMetadata
    # Image-conditioned models (Wan2.1 I2V) attend to the image tokens in a second, separate call
    # whose keys are those tokens (always dense: every image gives the same token count).
    image_cross_attn: AttentionMetadata = AttentionMetadata()
