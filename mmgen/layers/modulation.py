"""AdaLN-style modulation: a learned table plus a timestep projection gives shift/scale/gate vectors."""

from __future__ import annotations

import torch


def modulation_vectors(table: torch.Tensor, projection: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Table [1, count, D] + timestep projection [B, count, D] in float32 -> `count` tensors [B, 1, D] float32."""
    return (table.float() + projection.float()).chunk(count, dim=1)


def modulate(normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """normed * (1 + scale) + shift; normed [B, S, D] float32, shift/scale [B, 1, D] float32."""
    return normed * (1 + scale) + shift
