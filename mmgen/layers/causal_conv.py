"""Causal 3D convolutions with a per-decode frame cache: how Wan's VAE decodes one latent frame per call.

A causal conv pads time on the past side only (2 * p frames before, none after), so an output frame
depends on its input frame and the ones before it. Decoding one latent frame per call, each 3-tap
temporal conv reads the last CACHE_T input frames the previous call left in its slot of a cache
list (one slot per conv, taken in call order through a one-element cursor list). The caches belong
to one decode: the caller makes the list (causal_conv_count slots) and drops it afterwards.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CACHE_T = 2  # input frames a causal 3-tap temporal conv keeps for the next call


class CausalConv3d(nn.Conv3d):
    """A Conv3d padded causally in time (2 * p frames before, none after), or with the cached frames."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int | tuple[int, int, int], padding: Any = 0):
        super().__init__(in_dim, out_dim, kernel, padding=padding)
        t, h, w = self.padding
        self.causal_padding = (w, w, h, h, 2 * t, 0)  # F.pad order: W, H, T
        self.padding = (0, 0, 0)

    def forward(self, x: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        padding = list(self.causal_padding)
        if cache is not None and padding[4] > 0:
            x = torch.cat([cache.to(x.device), x], dim=2)
            padding[4] -= cache.shape[2]
        return super().forward(F.pad(x, padding))


def cached_conv(conv: nn.Module, x: torch.Tensor, cache: list[Any], index: list[int]) -> torch.Tensor:
    """A causal conv over x [B, C, t, H, W] reading its slot's cached frames; the slot then keeps the
    last CACHE_T input frames (the previous call's last frame when this call brings only one)."""
    slot = index[0]
    keep = x[:, :, -CACHE_T:].clone()
    if keep.shape[2] < CACHE_T and cache[slot] is not None:
        keep = torch.cat([cache[slot][:, :, -1:].to(keep.device), keep], dim=2)
    out = conv(x, cache[slot])
    cache[slot] = keep
    index[0] += 1
    return out


def causal_conv_count(decoder: nn.Module) -> int:
    """Cache slots a decode needs: at most one per 3D conv of the decoder (all of them causal)."""
    return sum(isinstance(module, nn.Conv3d) for module in decoder.modules())
