"""A Linear layer with a low-rank product beside its frozen weight (unfused LoRA).

`LowRankLinear` takes over an existing nn.Linear *without copying it*: it holds the very same
weight and bias Parameter objects, so state-dict keys, values and any views into a stacked matrix
(WanAttention.fuse_projections) stay what they were, and putting the original module back undoes
it exactly. The adapter is one pair of matrices whatever the number of LoRAs: their down matrices
stacked along the rank, their up matrices stacked likewise and pre-multiplied by each LoRA's scale,
so the extra cost per call is two thin GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LowRankLinear(nn.Linear):
    """y = x W^T + b + (x D^T) U^T, with W, b those of `base` (shared) and D [R, in], U [out, R]."""

    def __init__(self, base: nn.Linear, down: torch.Tensor, up: torch.Tensor) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: that would allocate a second weight
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self._original = (base,)  # a tuple: the original module is remembered, not registered as a child
        if tuple(down.shape) != (down.shape[0], base.in_features) or tuple(up.shape) != (
            base.out_features,
            down.shape[0],
        ):
            raise ValueError(
                f"low-rank pair down {tuple(down.shape)}, up {tuple(up.shape)} does not fit "
                f"Linear({base.in_features}, {base.out_features})"
            )
        # Buffers (not persistent): they follow .to() with the module and stay out of the state dict.
        self.register_buffer("lora_down", down, persistent=False)
        self.register_buffer("lora_up", up, persistent=False)

    @property
    def original(self) -> nn.Linear:
        """The nn.Linear this layer took over (same weight and bias objects)."""
        return self._original[0]

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> (x D^T) U^T [..., out] in x's dtype."""
        return F.linear(F.linear(x, self.lora_down), self.lora_up)

    def add_low_rank_(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [..., out] += (x D^T) U^T, in place where y's rows allow it (returns the result).

        The up-projection's GEMM adds into y itself (addmm_), so the low-rank term costs no extra
        full-size read and write of the output; y may be a column slice of a wider output (the
        stacked q/k/v GEMM), as long as its leading dimensions flatten into rows.
        """
        hidden = F.linear(x, self.lora_down)
        try:
            rows = y.view(-1, y.shape[-1])
        except RuntimeError:  # leading dimensions that do not flatten: add out of place
            return y + F.linear(hidden, self.lora_up)
        rows.addmm_(hidden.reshape(-1, hidden.shape[-1]), self.lora_up.t())
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_low_rank_(x, F.linear(x, self.weight, self.bias))


def add_low_rank(layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y + layer's low-rank term of x when `layer` carries one, else y unchanged.

    For code that computes a Linear's output without calling it (a stacked q/k/v GEMM), so an
    unfused LoRA on that layer is not silently skipped.
    """
    return layer.add_low_rank_(x, y) if isinstance(layer, LowRankLinear) else y
