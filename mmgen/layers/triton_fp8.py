"""Triton row quantization to FP8 e4m3 for inputs that no mmgen kernel produces (issue 20).

Imported only on CUDA (mmgen.layers.fp8_linear decides when). One pass: each program reads ROWS
rows of K columns once (bf16/fp16/fp32), optionally applies the tanh GELU (the FFN's activation, so
the down-projection's input is quantized where the GELU is computed), takes each row's absolute
maximum, and writes the fp8 values and one float32 scale per row. float32 math throughout; the
torch reference is fp8_linear.quantize_rows_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Literals inside the kernels (Triton refuses plain module globals in @jit code): e4m3's largest
# finite value 448, and the amax floor 1e-12 of mmgen.layers.fp8_linear (a zero row stays zero).


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    rows,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    GELU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    row_mask = row < rows
    mask = row_mask[:, None] & (cols < K)[None, :]
    offsets = row[:, None] * K + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * tl.sigmoid(2.0 * u)
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    scale = tl.maximum(amax, 1e-12) / 448.0
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(out_ptr + offsets, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row, scale, mask=row_mask)


def quantize_rows(
    x: torch.Tensor, *, gelu: bool = False, rows: int | None = None, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] contiguous -> (values float8_e4m3fn [..., K], scales float32 [..., 1])."""
    k = x.shape[-1]
    count = x.numel() // max(k, 1)
    block = triton.next_power_of_2(k)
    rows = rows if rows is not None else max(1, min(4, 4096 // block))
    num_warps = num_warps if num_warps is not None else max(1, min(16, block * rows // 512))
    values = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(count, rows),)
    _quantize_rows_kernel[grid](
        x, values, scales, count, K=k, BLOCK=block, ROWS=rows, GELU=gelu, num_warps=num_warps
    )
    return values, scales


@triton.jit
def _scale_heads_kernel(
    x_ptr,
    inv_ptr,
    out_ptr,
    rows,
    seq_len,
    WIDTH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
):
    # x [B, S, H, D] seen as rows [B * S, H * D]; each column takes its (batch, head) inverse scale.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (cols < WIDTH)[None, :]
    heads = WIDTH // HEAD_DIM
    batch = row // seq_len
    inv = tl.load(inv_ptr + batch[:, None] * heads + (cols // HEAD_DIM)[None, :], mask=mask, other=0.0)
    x = tl.load(x_ptr + row[:, None] * WIDTH + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x * inv, -448.0, 448.0)
    tl.store(out_ptr + row[:, None] * WIDTH + cols[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)


def scale_heads(x: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] contiguous, inverse scales float32 [B, H] -> float8_e4m3fn x * inverse (one pass)."""
    batch, seq_len, heads, head_dim = x.shape
    width = heads * head_dim
    block = triton.next_power_of_2(width)
    rows = max(1, min(4, 4096 // block))
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    grid = (triton.cdiv(batch * seq_len, rows),)
    _scale_heads_kernel[grid](
        x,
        inverse.contiguous(),
        out,
        batch * seq_len,
        seq_len,
        WIDTH=width,
        HEAD_DIM=head_dim,
        BLOCK=block,
        ROWS=rows,
        num_warps=max(1, min(16, block * rows // 512)),
    )
    return out
