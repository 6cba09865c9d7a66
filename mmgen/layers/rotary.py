"""3D rotary position embeddings of video DiTs (Wan): tables built once per model call, applied per layer.

The head dimension is split into a frame part and two equal spatial parts (Wan's split: height and
width get 2 * (head_dim // 6) channels each, frames the rest). Each part rotates channel pairs
(2i, 2i + 1) by position * theta ** (-2i / part_dim), with the angles computed in float64 and the
cos/sin tables stored in float32, as the reference implementations do.
"""

from __future__ import annotations

import torch

from mmgen.errors import ValidationError


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Channels of (frames, height, width) in one head: Wan's split of head_dim."""
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


def rope_3d_tables(
    grid: tuple[int, int, int],
    head_dim: int,
    *,
    device: torch.device | str,
    theta: float = 10000.0,
    max_positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: float32 [1, F*H*W, 1, head_dim // 2] for a (frames, height, width) token grid, row-major."""
    if head_dim % 2:
        raise ValidationError(f"rotary head_dim must be even, got {head_dim}")
    if max_positions is not None and max(grid) > max_positions:
        raise ValidationError(
            f"token grid {tuple(grid)} exceeds the model's rope_max_seq_len={max_positions} positions per axis"
        )
    angles = []
    for axis, (length, dim) in enumerate(zip(grid, rope_axis_dims(head_dim), strict=True)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))
        axis_angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv_freq)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = length
        angles.append(axis_angles.view(shape).expand(*grid, dim // 2))
    table = torch.cat(angles, dim=-1).reshape(1, -1, 1, head_dim // 2)
    return table.cos().float(), table.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x [B, S, H, D] by float32 tables [1, S, 1, D // 2]; computed in fp32, returns x's dtype."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
