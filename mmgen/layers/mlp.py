"""Feed-forward blocks with the parameter layout of diffusers' FeedForward (checkpoint names match)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GeluTanhProjection(nn.Module):
    """Linear then tanh-approximated GELU; its weights live under `proj` as in diffusers' GELU module."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class GeluTanhFeedForward(nn.Module):
    """x [..., dim] -> Linear(dim, inner) -> GELU(tanh) -> Linear(inner, dim).

    The layers sit at net.0 and net.2: checkpoints keep a dropout at index 1, which holds no weights,
    so an Identity keeps the indices (and thus the state-dict keys) the checkpoints use.
    """

    def __init__(self, dim: int, inner_dim: int) -> None:
        super().__init__()
        self.net = nn.ModuleList(
            [GeluTanhProjection(dim, inner_dim), nn.Identity(), nn.Linear(inner_dim, dim)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x
