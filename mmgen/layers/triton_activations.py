"""Triton kernel for a gated MLP's activation: silu(gate) * up in one pass.

Imported only on CUDA (mmgen.layers.fused_activations decides when; its torch reference is the CPU
path and the GPU tests' oracle). Eager torch runs silu(gate) * up as two kernels: silu reads gate and
writes a [rows, hidden] intermediate, the multiply reads it and up and writes the result (5 passes of
[rows, hidden]); this kernel reads gate and up once and writes the result once (3 passes). The math
is float32 and the result is rounded once to its dtype (torch rounds silu's output first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    columns,
    gate_row_stride,
    up_row_stride,
    BLOCK: tl.constexpr,
):
    # Program (row, block): BLOCK columns of one row. Rows on grid axis 0 (up to 2^31 - 1 programs;
    # axis 1 allows only 65,535), column blocks on axis 1.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < columns
    gate = tl.load(gate_ptr + row * gate_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * up_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g / (1 + exp(-g)), torch's formula; g -> -inf gives -0, as there.
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * columns + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, block: int = 2048, num_warps: int = 8) -> torch.Tensor:
    """gate, up [R, C] (unit column stride, any row stride: e.g. column slices of one wider
    projection) -> silu(gate) * up, contiguous [R, C] in gate's dtype.

    A program takes `block` columns of one row (a power of 2): 2,048 on 8 warps is 8 elements a
    thread, one 16-byte load per tensor in bf16.
    """
    rows, columns = gate.shape
    out = torch.empty((rows, columns), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    block = min(block, triton.next_power_of_2(columns))
    grid = (rows, triton.cdiv(columns, block))
    _silu_mul_kernel[grid](
        gate,
        up,
        out,
        columns,
        gate.stride(0),
        up.stride(0),
        BLOCK=block,
        num_warps=max(1, min(num_warps, block // 256)),
    )
    return out
