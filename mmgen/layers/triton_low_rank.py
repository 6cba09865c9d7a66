"""Triton kernels for unfused LoRA: a GEMM with the up-projection in its main loop, and a one-pass add.

linear_plus_low_rank: out = act(x W^T + b + low U^T) in one GEMM.
Imported only on CUDA where Triton exists (mmgen.layers.low_rank decides). The low-rank term is R
more steps of the same float32 accumulator (the K dimension extended by the rank), so the output is
written once, rounded once, and no pass re-reads it; bias and the tanh GELU run on the accumulator
before the store, as cuBLASLt's epilogue does for the plain FFN. low = x D^T comes from a cuBLAS GEMM
before the call (it needs all of x's columns, which no single output tile has).

The main loop is the classic tiled GEMM (grouped tile order for L2 reuse of W, K steps of BLOCK_K),
autotuned per (N, K, R) over a few Hopper-sized configs.

add_low_rank_: y <- act(y + low U^T) in place, for the output of a cuBLAS GEMM (memory-bound: one read
and one write of y, the up-projection and the FFN's GELU in the same pass).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mmgen.layers.low_rank_tiles import GROUP_ALIGN

# Every BLOCK_N here (and in _ADD_CONFIGS) divides GROUP_ALIGN, so tiles never straddle stacked layers.
_CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=4),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=4, num_warps=8),
]
BLOCK_R = 32  # rank steps; the rank is padded (masked) to a multiple of this


def _check_groups(n: int, rank: int, low: torch.Tensor, group_cols: int | None) -> int:
    """group_cols (N when None), checked: tiles never straddle two layers, low has every layer's rank."""
    group_cols = n if group_cols is None else group_cols
    if group_cols != n and (group_cols % GROUP_ALIGN or n % group_cols):
        raise ValueError(f"group_cols {group_cols} must divide N={n} and be a multiple of {GROUP_ALIGN}")
    if low.shape[1] != (n // group_cols) * rank:
        raise ValueError(
            f"low has {low.shape[1]} columns, expected {(n // group_cols) * rank} (groups x rank)"
        )
    return group_cols


@triton.autotune(configs=_CONFIGS, key=["N", "K", "R", "HAS_BIAS", "GELU"])
@triton.jit
def _linear_low_rank_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    low_ptr,
    up_ptr,
    out_ptr,
    M,
    N,
    K,
    R,
    group_cols,
    stride_xm,
    stride_wn,
    stride_lm,
    stride_un,
    stride_om,
    HAS_BIAS: tl.constexpr,
    GELU: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Tile order: GROUP_M row tiles sweep the column tiles together, so W's tiles stay in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Out-of-range rows/columns load a valid row (modulo) and are masked at the store only.
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows_in[:, None] * stride_xm + ks[None, :]
    w_tile = w_ptr + cols_in[None, :] * stride_wn + ks[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(x_tile)
            b = tl.load(w_tile)
        else:
            left = K - step * BLOCK_K
            a = tl.load(x_tile, mask=ks[None, :] < left, other=0.0)
            b = tl.load(w_tile, mask=ks[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K

    # The low-rank term: the same accumulator, R more steps (low [M, G*R], U^T [R, N]). Stacked layers
    # (q/k/v) each own group_cols columns and R rank columns of low; a tile lies in one group.
    rs = tl.arange(0, BLOCK_R)
    group = (pid_n * BLOCK_N) // group_cols
    low_tile = low_ptr + rows_in[:, None] * stride_lm + group * R + rs[None, :]
    up_tile = up_ptr + cols_in[None, :] * stride_un + rs[:, None]
    for step in range(0, tl.cdiv(R, BLOCK_R)):
        left = R - step * BLOCK_R
        a = tl.load(low_tile, mask=rs[None, :] < left, other=0.0)
        b = tl.load(up_tile, mask=rs[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc)
        low_tile += BLOCK_R
        up_tile += BLOCK_R

    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
    if GELU:
        # tanh GELU: 0.5 y (1 + tanh(u)) = y * sigmoid(2u), u = sqrt(2/pi) (y + 0.044715 y^3).
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * inner)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@torch.compiler.disable  # autotuned launches stay out of compiled graphs (compile_blocks): a graph break
def linear_plus_low_rank(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    low: torch.Tensor,
    up: torch.Tensor,
    activation: str | None,
    group_cols: int | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] or None, low [M, G*R], up [N, R] -> act(x W^T + b + low U^T) [M, N].

    With group_cols (a multiple of GROUP_ALIGN dividing N): N is G stacked layers of group_cols
    outputs each, layer g using low's rank columns g*R..(g+1)*R (U^T is block-diagonal then, without
    its zeros stored or multiplied). All on one CUDA device in one half dtype (bias may be float32).
    """
    x, weight, low, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, weight, low, up))
    M, K = x.shape
    N, R = weight.shape[0], up.shape[1]
    group_cols = _check_groups(N, R, low, group_cols)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    _linear_low_rank_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,  # never read without HAS_BIAS
        low,
        up,
        out,
        M,
        N,
        K,
        R,
        group_cols,
        x.stride(0),
        weight.stride(0),
        low.stride(0),
        up.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        GELU=activation == "gelu_tanh",
        EVEN_K=K % 64 == 0,
        BLOCK_R=BLOCK_R,
    )
    return out


_ADD_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_stages=3, num_warps=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_stages=3, num_warps=8),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_stages=3, num_warps=4),
]


# restore_value: the kernel works in place, so the autotuner's trial runs must not add the term twice.
@triton.autotune(configs=_ADD_CONFIGS, key=["N", "R", "GELU"], restore_value=["y_ptr"])
@triton.jit
def _add_low_rank_kernel(
    y_ptr,
    low_ptr,
    up_ptr,
    M,
    N,
    R,
    group_cols,
    stride_ym,
    stride_lm,
    stride_un,
    GELU: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One pass over y: read the tile once, add its low-rank term, activate, write it back in place.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = (rows % M).to(tl.int64)
    cols_in = (cols % N).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    y_tile = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    acc = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    rs = tl.arange(0, BLOCK_R)
    group = (pid_n * BLOCK_N) // group_cols  # as in the GEMM kernel: the tile's layer in a stack
    low_tile = low_ptr + rows_in[:, None] * stride_lm + group * R + rs[None, :]
    up_tile = up_ptr + cols_in[None, :] * stride_un + rs[:, None]
    for step in range(0, tl.cdiv(R, BLOCK_R)):
        left = R - step * BLOCK_R
        a = tl.load(low_tile, mask=rs[None, :] < left, other=0.0)
        b = tl.load(up_tile, mask=rs[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc)
        low_tile += BLOCK_R
        up_tile += BLOCK_R
    if GELU:
        inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = acc * tl.sigmoid(2.0 * inner)
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mask)


@torch.compiler.disable
def add_low_rank_(
    y: torch.Tensor,
    low: torch.Tensor,
    up: torch.Tensor,
    activation: str | None,
    group_cols: int | None = None,
) -> torch.Tensor:
    """y [M, N] <- act(y + low U^T) in place (low [M, G*R], up [N, R], group_cols as in
    linear_plus_low_rank); returns y.

    The cuBLAS GEMM wrote y (with its bias); this is the one memory-bound pass that adds the LoRA
    term and, for the FFN, applies the GELU (which the separate path runs as a second pass).
    """
    if y.stride(-1) != 1:
        raise ValueError(f"add_low_rank_: y must have unit column stride, got strides {y.stride()}")
    low, up = (t if t.stride(-1) == 1 else t.contiguous() for t in (low, up))
    M, N = y.shape
    R = up.shape[1]
    group_cols = _check_groups(N, R, low, group_cols)
    if M == 0:
        return y
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
    _add_low_rank_kernel[grid](
        y, low, up, M, N, R, group_cols, y.stride(0), low.stride(0), up.stride(0),
        GELU=activation == "gelu_tanh", BLOCK_R=BLOCK_R,
    )  # fmt: skip
    return y
