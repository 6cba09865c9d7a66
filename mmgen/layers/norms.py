"""Normalization layers that compute in float32 whatever the activations' dtype (as the Wan reference does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 (weights upcast too); returns the input's dtype. x [..., dim]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)
