"""Projections that share one stacked weight: one wide GEMM instead of several narrow ones.

A module's nn.Linear children that read the same input (an attention's q/k/v, a SwiGLU's gate and up)
can run as one GEMM against their weights stacked along rows. The stack becomes the storage of the
layers' own parameters, which turn into row slices of it: no second copy of the weights exists, the
state dict keeps its keys and values, and load_state_dict (copying in place) updates both views.
Moving or casting the module (.to, .half) re-stacks automatically (`_apply`); a
load_state_dict(assign=True) replaces the parameters, so stack again after one. For inference: the
stacked path reads the stack, not the parameters, so it would not carry gradients to them. The wider
GEMM may round differently from the narrow ones (bf16 rounding, nothing more).
"""

from __future__ import annotations

import torch
from torch import nn


class StackedProjections(nn.Module):
    """Base of a module whose named nn.Linear children may share one stacked weight (module docstring).

    fused_projections: the stacked layers' names in stacking order (empty: not stacked); fused_weight
    [sum of out, in] and fused_bias (None where the layers have none): non-persistent buffers.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fused_projections: tuple[str, ...] = ()
        self.register_buffer("fused_weight", None, persistent=False)
        self.register_buffer("fused_bias", None, persistent=False)

    def stack_projections(self, names: tuple[str, ...]) -> None:
        """Stack the named layers (same input size, all with a bias or all without) into one matrix."""
        layers = [getattr(self, name) for name in names]
        with torch.no_grad():
            weight = torch.cat([layer.weight.detach() for layer in layers])
            has_bias = layers[0].bias is not None
            bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None
        start = 0
        for layer in layers:
            rows = layer.out_features
            layer.weight.data = weight[start : start + rows]
            if bias is not None:
                layer.bias.data = bias[start : start + rows]
            start += rows
        self.fused_weight, self.fused_bias = weight, bias
        self.fused_projections = tuple(names)

    def _apply(self, fn, recurse=True):  # nn.Module's hook for .to(), .half(), ...
        super()._apply(fn, recurse)
        if self.fused_projections:
            # The conversion made separate tensors of the weight views and of the stack: share again.
            self.stack_projections(self.fused_projections)
        return self
