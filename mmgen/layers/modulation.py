"""AdaLN-style modulation: a learned table plus a timestep projection gives shift/scale/gate vectors.

The helpers computing in float32 and storing the activations' dtype use `torch.addcmul(..., out=)`:
it promotes its inputs to float32 and rounds once on store, so eager mode runs one kernel where
`(a.float() + b * c).to(dtype)` runs three or four; under torch.compile it fuses either way.
"""

from __future__ import annotations

import torch


def modulation_vectors(table: torch.Tensor, projection: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Table [1, count, D] + timestep projection in float32 -> `count` float32 vectors.

    projection [B, count, D] (one timestep per sample) gives [B, 1, D] each; projection
    [B, S, count, D] (one timestep per token, Wan2.2 TI2V) gives [B, S, D] each. A projection of
    1 where count stands is broadcast to every row of the table.
    """
    total = table.float() + projection.float()
    return total.unbind(2) if projection.dim() == 4 else total.chunk(count, dim=1)


def modulate(normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """normed * (1 + scale) + shift; normed [B, S, D] float32, shift/scale [B, 1, D] float32."""
    return normed * (1 + scale) + shift


def modulate_as(
    normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """modulate() in float32, stored as `dtype`; normed [B, S, D] float32, shift/scale [B, 1, D] float32."""
    return torch.addcmul(shift, normed, 1 + scale, out=normed.new_empty(normed.shape, dtype=dtype))


def gated_residual(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + update * gate in float32, stored in x's dtype; x/update [B, S, D], gate [B, 1, D] float32."""
    return torch.addcmul(x, update, gate, out=torch.empty_like(x))
