"""A gated MLP's activation, silu(gate) * up (SwiGLU), in one pass on CUDA.

Two implementations of one formula, as in mmgen.layers.fused_norms: torch's F.silu(gate) * up (the
CPU path, the op-by-op path on CUDA, and the GPU tests' oracle) and, on CUDA where Triton imports, one
Triton kernel (mmgen.layers.triton_activations) that reads gate and up once and writes the result
once, in float32, rounded once: it differs from torch's bf16 result by the skipped rounding of silu's
output. Registered as a torch custom op (namespace `mmgen`, CUDA only), as the row kernels are, so
torch.compile treats it as one opaque call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mmgen.layers.compile_guard import opaque_op
from mmgen.layers.fused_norms import kernel_applies


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, kernel: bool = True) -> torch.Tensor:
    """silu(gate) * up; gate, up [..., C] of one shape and dtype -> [..., C] in that dtype.

    kernel: run the Triton kernel where it applies (a CUDA tensor of a kernel dtype); False, or
    anywhere else, torch's two ops. The kernel takes any row stride with unit column stride (a column
    slice of a wider projection reads in place) and returns a contiguous tensor.
    """
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(
            f"silu_mul: gate {tuple(gate.shape)} {gate.dtype} {gate.device} and up {tuple(up.shape)} "
            f"{up.dtype} {up.device} must match"
        )
    if kernel_applies(gate, kernel):
        return _silu_mul_cuda(_rows(gate), _rows(up)).view(gate.shape)
    return F.silu(gate) * up


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] as [R, C] with unit column stride: a view where the strides allow, else a copy."""
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


@opaque_op("mmgen::silu_mul")
def _silu_mul_cuda(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from mmgen.layers import triton_activations  # imports triton (optional): on the first CUDA call

    return triton_activations.silu_mul(gate, up)


@_silu_mul_cuda.register_fake
def _silu_mul_shape(gate, up):
    return gate.new_empty(gate.shape)
