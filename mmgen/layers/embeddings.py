"""Timestep, text and patch embeddings of diffusion transformers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def timestep_sinusoid(timesteps: torch.Tensor, dim: int, *, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features [B, dim] float32 of timesteps [B], cosines first (diffusers' flip_sin_to_cos=True, shift 0)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angles = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    features = torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)
    if dim % 2:
        features = F.pad(features, (0, 1))
    return features


class TimestepMLP(nn.Module):
    """Sinusoid features [B, in_dim] -> Linear -> SiLU -> Linear -> [B, dim] (diffusers' TimestepEmbedding layout)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TextProjection(nn.Module):
    """Text features [B, L, in_dim] -> Linear -> GELU(tanh) -> Linear -> [B, L, dim] (PixArt-alpha layout)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


def patch_tokens(
    patch_embedding: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor
) -> torch.Tensor:
    """Latents [B, C, F, H, W] -> tokens [B, F'*H'*W', dim] (frame-major, then rows, then columns).

    patch_embedding: the model's Conv3d (or a callable that applies it and returns [B, dim, F', H', W']).
    """
    return patch_embedding(latents).flatten(2).transpose(1, 2).contiguous()


def unpatchify(
    tokens: torch.Tensor, grid: tuple[int, int, int], patch_size: tuple[int, int, int], channels: int
) -> torch.Tensor:
    """Tokens [B, F'*H'*W', pt*ph*pw*C] (channel fastest) -> video [B, C, F'*pt, H'*ph, W'*pw]."""
    frames, height, width = grid
    pt, ph, pw = patch_size
    x = tokens.reshape(tokens.shape[0], frames, height, width, pt, ph, pw, channels)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(tokens.shape[0], channels, frames * pt, height * ph, width * pw)
