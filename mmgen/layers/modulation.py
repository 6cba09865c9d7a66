"""AdaLN-style modulation: a learned table plus a timestep projection gives shift/scale/gate vectors.

Vectors come as a table [N, 1, D] float32. With one timestep per sample, N = B and sample b reads
row b. With one timestep per token (Wan2.2 TI2V), the timesteps take only a few distinct values (the
conditioning frame's 0 and the step's t), so the table holds one row per distinct value and a
per-token index `token_rows` [B, S] says which row each token reads (distinct_timesteps): the
per-token vectors are never materialized, and the time embedding runs on N rows instead of B * S.

The helpers computing in float32 and storing the activations' dtype use `torch.addcmul(..., out=)`:
it promotes its inputs to float32 and rounds once on store, so eager mode runs one kernel where
`(a.float() + b * c).to(dtype)` runs three or four; under torch.compile it fuses either way.
"""

from __future__ import annotations

import torch
from torch import nn

from mmgen.errors import ValidationError
from mmgen.layers.meta_init import building_on_meta


def scale_shift_table(rows: int, dim: int) -> nn.Parameter:
    """The learned modulation table [1, rows, dim], initialized randn / sqrt(dim) (Wan's init).

    Built on the meta device (every checkpoint load) it is left empty: see mmgen.layers.meta_init.
    """
    if building_on_meta():
        return nn.Parameter(torch.empty(1, rows, dim))
    return nn.Parameter(torch.randn(1, rows, dim) / dim**0.5)


def distinct_timesteps(timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token timesteps [B, S] float -> (values [N] float, token_rows [B, S] int32 with values[token_rows] == timestep).

    Sorted distinct values; reads the count back from the device once (one sync per model call).
    """
    values, inverse = torch.unique(timestep, return_inverse=True)
    return values, inverse.to(torch.int32)


def modulation_vectors(table: torch.Tensor, projection: torch.Tensor, count: int) -> tuple[torch.Tensor, ...]:
    """Table [1, count, D] + timestep projection [N, count, D] in float32 -> `count` float32 vectors [N, 1, D].

    N is the batch (one timestep per sample) or the distinct timesteps of a per-token form. A
    projection of 1 where count stands is broadcast to every row of the table.
    """
    return (table.float() + projection.float()).chunk(count, dim=1)


def token_vectors(vector: torch.Tensor, token_rows: torch.Tensor | None) -> torch.Tensor:
    """vector [N, 1, D] -> what token (b, s) reads: [B, S, D] row token_rows[b, s], or vector itself (N = B).

    The torch path's per-token vectors; the Triton kernels index the table instead.
    """
    if token_rows is None:
        return vector
    return vector[:, 0].index_select(0, token_rows.flatten()).view(*token_rows.shape, -1)


def check_token_rows(x: torch.Tensor, token_rows: torch.Tensor | None) -> None:
    """token_rows must be an integer [B, S] matching x [B, S, D] (host check of shape and dtype only)."""
    if token_rows is None:
        return
    if token_rows.shape != x.shape[:2] or token_rows.dtype not in (torch.int32, torch.int64):
        raise ValidationError(
            f"token_rows must be int32/int64 of shape {tuple(x.shape[:2])} (x's [B, S]), "
            f"got {token_rows.dtype} {tuple(token_rows.shape)}"
        )


def modulate(normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """normed * (1 + scale) + shift; normed [B, S, D] float32, shift/scale [B, 1, D] or [B, S, D] float32."""
    return normed * (1 + scale) + shift


def modulate_as(
    normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """modulate() in float32, stored as `dtype`; normed [B, S, D] float32, shift/scale [B, 1, D] or [B, S, D]."""
    return torch.addcmul(shift, normed, 1 + scale, out=normed.new_empty(normed.shape, dtype=dtype))


def gated_residual(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x + update * gate in float32, stored in x's dtype; x/update [B, S, D], gate [B, 1, D] or [B, S, D] float32."""
    return torch.addcmul(x, update, gate, out=torch.empty_like(x))
