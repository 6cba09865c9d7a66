"""3D rotary position embeddings of video DiTs (Wan): tables built once per model call, applied per layer.

The head dimension is split into a frame part and two equal spatial parts (Wan's split: height and
width get 2 * (head_dim // 6) channels each, frames the rest). Each part rotates channel pairs
(2i, 2i + 1) by position * theta ** (-2i / part_dim), with the angles computed in float64 and the
cos/sin tables stored in float32, as the reference implementations do.

Table layout: both tables are full head width and real-valued, so one rotation is two multiplies
and an add over x and its pair-swapped copy (no complex numbers, no per-layer reshuffling):
    cos_full[..., 2i] = cos_full[..., 2i + 1] = cos(angle_i)
    sin_signed[..., 2i] = -sin(angle_i),  sin_signed[..., 2i + 1] = +sin(angle_i)
    rope(x) = x * cos_full + swap_pairs(x) * sin_signed
which gives out[2i] = x[2i] cos - x[2i+1] sin and out[2i+1] = x[2i+1] cos + x[2i] sin.
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
    """cos_full, sin_signed: float32 [1, F*H*W, 1, head_dim] for a (frames, height, width) grid, row-major."""
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
    cos, sin = table.cos().float(), table.sin().float()
    cos_full = torch.stack((cos, cos), dim=-1).flatten(-2)
    sin_signed = torch.stack((-sin, sin), dim=-1).flatten(-2)
    return cos_full, sin_signed


def apply_rope(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of x [B, S, H, D] by float32 tables [1, S, 1, D]; computed in fp32, returns x's dtype."""
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    # addcmul computes in float32 (the promoted dtype) and stores x's dtype: one pass, no fp32 copy of x.
    return torch.addcmul(x * cos_full, swapped, sin_signed, out=torch.empty_like(x))
