"""Triton kernels for the DiT's row passes: residual + LayerNorm + modulation, and RMSNorm + RoPE.

Imported only on CUDA (mmgen.layers.fused_norms decides when); every kernel has a torch reference
there, and the GPU tests compare the two. One kernel covers the block's residual/LayerNorm passes
(constexpr flags pick residual, gate, affine, modulation, norm); one the q/k RMSNorm (+ RoPE). Each
program handles ROWS rows of one batch element, so per-sample vectors (modulation shift/scale, gate)
are read once per program and broadcast; per-token vectors (PER_TOKEN: a table of a few rows, one per
distinct timestep, and an int index per token) are gathered per row from that small, cache-resident
table. A row is one register tile of BLOCK >= dim columns, read once from memory and written once.
All arithmetic is float32; each output is rounded once to its dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _vector(ptr, stride, owner, cols, col_mask, mask, PER_TOKEN: tl.constexpr):
    """A float32 modulation vector for the tile: [1, BLOCK] (row `owner`, the batch index) or, PER_TOKEN,
    [ROWS, BLOCK] (row owner[i] of the table for tile row i)."""
    if PER_TOKEN:
        vector = tl.load(ptr + owner[:, None] * stride + cols[None, :], mask=mask, other=0.0)
    else:
        vector = tl.load(ptr + owner * stride + cols, mask=col_mask, other=0.0)[None, :]
    return vector.to(tl.float32)


@triton.jit
def _residual_layer_norm_kernel(
    x_ptr,
    update_ptr,
    gate_ptr,
    weight_ptr,
    bias_ptr,
    shift_ptr,
    scale_ptr,
    x_out_ptr,
    out_ptr,
    out_scale_ptr,
    token_rows_ptr,
    seq_len,
    gate_stride,
    shift_stride,
    scale_stride,
    eps,
    out_row_stride,  # DIM, or DIM + spare columns the caller fills later (the concat LoRA kernel)
    DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_UPDATE: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_AFFINE: tl.constexpr,
    HAS_MODULATION: tl.constexpr,
    HAS_NORM: tl.constexpr,
    FP8_OUT: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    positions = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < DIM
    row_mask = positions < seq_len
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = (batch * seq_len + positions)[:, None] * DIM + cols[None, :]
    # Which row of the vector tables each tile row reads: its token's entry, or its batch element.
    if PER_TOKEN:
        owner = tl.load(token_rows_ptr + batch * seq_len + positions, mask=row_mask, other=0).to(tl.int64)
    else:
        owner = batch
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPDATE:
        update = tl.load(update_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:
            update = update * _vector(gate_ptr, gate_stride, owner, cols, col_mask, mask, PER_TOKEN)
        # The residual stream is stored in its own dtype and the norm reads the stored (rounded) value,
        # as the unfused model does.
        stored = (x + update).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + offsets, stored, mask=mask)
        x = stored.to(tl.float32)
    if HAS_NORM:
        mean = tl.sum(x, axis=1) / DIM
        centered = tl.where(mask, x - mean[:, None], 0.0)
        variance = tl.sum(centered * centered, axis=1) / DIM
        y = centered * (1.0 / tl.sqrt(variance + eps))[:, None]
        if HAS_AFFINE:
            weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * weight[None, :] + bias[None, :]
        if HAS_MODULATION:
            scale = _vector(scale_ptr, scale_stride, owner, cols, col_mask, mask, PER_TOKEN)
            shift = _vector(shift_ptr, shift_stride, owner, cols, col_mask, mask, PER_TOKEN)
            y = y * (1.0 + scale) + shift
        if FP8_OUT:
            # The next linear's input, quantized per row here (mmgen.layers.fp8_linear): the row is
            # in registers already, so the fp8 values and the scale cost no extra pass.
            amax = tl.max(tl.where(mask, tl.abs(y), 0.0), axis=1)
            row_scale = tl.maximum(amax, 1e-12) / 448.0
            y = tl.clamp(y / row_scale[:, None], -448.0, 448.0)
            tl.store(out_scale_ptr + batch * seq_len + positions, row_scale, mask=positions < seq_len)
        out_offsets = (batch * seq_len + positions)[:, None] * out_row_stride + cols[None, :]
        tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_rope_kernel(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    seq_len,
    x_batch_stride,
    x_row_stride,
    eps,
    DIM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAIRS: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    # Columns are held as [pairs, 2] so RoPE's (2i, 2i + 1) partners sit in one thread: tl.split gives
    # the even and odd channels, tl.join puts the rotated pairs back, with no second load. (Loading
    # [ROWS, 2 * PAIRS] and reshaping in registers ran 15-35% slower on an H200.)
    batch = tl.program_id(1).to(tl.int64)
    positions = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    pairs = tl.arange(0, PAIRS)
    cols = pairs[:, None] * 2 + tl.arange(0, 2)[None, :]  # [PAIRS, 2]
    col_mask = cols < DIM
    row_mask = positions < seq_len
    mask = row_mask[:, None, None] & col_mask[None, :, :]
    rows_in = batch * x_batch_stride + positions * x_row_stride
    rows_out = (batch * seq_len + positions) * DIM
    x = tl.load(x_ptr + rows_in[:, None, None] + cols[None, :, :], mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(tl.sum(x * x, axis=2), axis=1) / DIM
    y = x * (1.0 / tl.sqrt(mean_square + eps))[:, None, None] * weight[None, :, :]
    if HAS_ROPE:
        even, odd = tl.split(y)  # [ROWS, PAIRS] each
        # Tables are full head width: cos_full[2i] = cos_full[2i + 1], sin_signed[2i + 1] = +sin.
        table = positions[:, None] * HEAD_DIM + (pairs * 2 % HEAD_DIM)[None, :]
        pair_mask = row_mask[:, None] & (pairs * 2 < DIM)[None, :]
        cos = tl.load(cos_ptr + table, mask=pair_mask, other=0.0)
        sin = tl.load(sin_ptr + table + 1, mask=pair_mask, other=0.0)
        y = tl.join(even * cos - odd * sin, odd * cos + even * sin)
    tl.store(out_ptr + rows_out[:, None, None] + cols[None, :, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _tile(dim: int, rows: int | None, num_warps: int | None, *, inputs: int) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps) for rows of `dim` columns read from `inputs` tensors.

    Defaults from an H200 sweep at dim 1536 (2026-11-21): one input (norm, norm + RoPE) 2 rows of
    2048 on 4 warps, 28% faster than 4 rows on 8; two inputs (residual + norm) 4 rows on 8 warps.
    """
    block = triton.next_power_of_2(dim)
    most = 4 if inputs > 1 else 2
    rows = rows if rows is not None else max(1, min(most, 8192 // block))
    num_warps = num_warps if num_warps is not None else max(1, min(16, block * rows // 1024))
    return block, rows, num_warps


def residual_layer_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    *,
    norm: bool = True,
    rows: int | None = None,
    num_warps: int | None = None,
    fp8_scales: torch.Tensor | None = None,
    token_rows: torch.Tensor | None = None,
    spare_columns: int = 0,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x, update [B, S, D] contiguous; gate/shift/scale [B, 1, D]; weight/bias [D] -> (x + update * gate, h).

    token_rows: int32/int64 [B, S]; gate/shift/scale are then tables [N, 1, D] and token (b, s) reads
    row token_rows[b, s] of each (values in [0, N), not checked here).

    h = LayerNorm(x_new) (* weight + bias) (* (1 + scale) + shift), in x's dtype; x_new is None
    without an update (h then normalizes x itself), h is None with norm=False (a residual only).
    fp8_scales: a float32 [B, S, 1] tensor to fill; h is then float8_e4m3fn, quantized per row
    (h ~= h_fp8 * fp8_scales; row scale = the row's absolute maximum / 448).
    spare_columns: h is [B, S, D + spare_columns], its first D columns written, the rest left as
    allocated (not with fp8_scales).
    """
    batch, seq_len, dim = x.shape
    block, rows, num_warps = _tile(dim, rows, num_warps, inputs=1 if update is None else 2)
    x_out = torch.empty_like(x) if update is not None else None
    fp8 = fp8_scales is not None
    if spare_columns and fp8:
        raise ValueError("residual_layer_norm: spare_columns with an fp8 output is not supported")
    padded = (batch, seq_len, dim + spare_columns)
    out = (
        (
            torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
            if fp8
            else torch.empty(padded, dtype=x.dtype, device=x.device)
        )
        if norm
        else None
    )
    dummy = x  # stands in for absent tensors; the constexpr flags keep it unread
    token_rows = None if token_rows is None else token_rows.contiguous()  # read at batch * S + s
    grid = (triton.cdiv(seq_len, rows), batch)
    _residual_layer_norm_kernel[grid](
        x,
        update if update is not None else dummy,
        gate if gate is not None else dummy,
        weight if weight is not None else dummy,
        bias if bias is not None else dummy,
        shift if shift is not None else dummy,
        scale if scale is not None else dummy,
        x_out if x_out is not None else dummy,
        out if out is not None else dummy,
        fp8_scales if fp8 else dummy,
        token_rows if token_rows is not None else dummy,
        seq_len,
        gate.stride(0) if gate is not None else 0,
        shift.stride(0) if shift is not None else 0,
        scale.stride(0) if scale is not None else 0,
        eps,
        dim + spare_columns,
        DIM=dim,
        BLOCK=block,
        ROWS=rows,
        HAS_UPDATE=update is not None,
        HAS_GATE=gate is not None,
        HAS_AFFINE=weight is not None,
        HAS_MODULATION=shift is not None,
        HAS_NORM=norm,
        FP8_OUT=fp8 and norm,
        PER_TOKEN=token_rows is not None,
        num_warps=num_warps,
    )
    return x_out, out


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    head_dim: int,
    *,
    rows: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """x [B, S, D] (unit column stride) -> RMSNorm(x) * weight, rotated per head by [1, S, 1, head_dim] tables; contiguous."""
    batch, seq_len, dim = x.shape
    block, rows, num_warps = _tile(dim, rows, num_warps, inputs=1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(seq_len, rows), batch)
    _rms_norm_rope_kernel[grid](
        x,
        weight,
        cos if cos is not None else weight,
        sin if sin is not None else weight,
        out,
        seq_len,
        x.stride(0),
        x.stride(1),
        eps,
        DIM=dim,
        HEAD_DIM=head_dim,
        PAIRS=block // 2,
        ROWS=rows,
        HAS_ROPE=cos is not None,
        num_warps=num_warps,
    )
    return out


@triton.jit
def _head_rms_norm_rope_kernel(
    x_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    out_rows_ptr,
    seq_len,
    x_batch_stride,
    x_row_stride,
    eps,
    HEADS: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    # A tile is [ROWS, HEAD_BLOCK, HEAD_DIM // 2, 2] (HEAD_BLOCK heads from program_id(2) * HEAD_BLOCK):
    # each head's mean square is a sum over the last two axes, and RoPE's (2i, 2i + 1) partners sit
    # in one thread as in _rms_norm_rope_kernel.
    batch = tl.program_id(1).to(tl.int64)
    positions = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    heads = tl.program_id(2) * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
    pairs = tl.arange(0, HEAD_DIM // 2)
    in_head = pairs[:, None] * 2 + tl.arange(0, 2)[None, :]  # [PAIRS, 2]
    cols = heads[:, None, None] * HEAD_DIM + in_head[None, :, :]  # [HEAD_BLOCK, PAIRS, 2]
    row_mask = positions < seq_len
    mask = row_mask[:, None, None, None] & (heads < HEADS)[None, :, None, None]
    rows_in = batch * x_batch_stride + positions * x_row_stride
    x = tl.load(x_ptr + rows_in[:, None, None, None] + cols[None], mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + in_head).to(tl.float32)
    mean_square = tl.sum(tl.sum(x * x, axis=3), axis=2) / HEAD_DIM  # [ROWS, HEAD_BLOCK]
    y = x * (1.0 / tl.sqrt(mean_square + eps))[:, :, None, None] * weight[None, None, :, :]
    if HAS_ROPE:
        even, odd = tl.split(y)  # [ROWS, HEAD_BLOCK, PAIRS] each
        # Full head-width tables as in _rms_norm_rope_kernel: cos at 2i, +sin at 2i + 1.
        table = positions[:, None] * HEAD_DIM + pairs[None, :] * 2  # [ROWS, PAIRS]
        cos = tl.load(cos_ptr + table, mask=row_mask[:, None], other=0.0)[:, None, :]
        sin = tl.load(sin_ptr + table + 1, mask=row_mask[:, None], other=0.0)[:, None, :]
        y = tl.join(even * cos - odd * sin, odd * cos + even * sin)
    out_rows = tl.load(out_rows_ptr + batch * seq_len + positions, mask=row_mask, other=0)
    out_offsets = out_rows[:, None, None, None] * (HEADS * HEAD_DIM) + cols[None]
    tl.store(out_ptr + out_offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


def head_rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    *,
    rows: int = 1,
    head_block: int = 4,
    num_warps: int = 1,
) -> torch.Tensor:
    """x [B, S, H * D] (unit column stride) -> RMSNorm of each head times weight [D], rotated by
    [S, D] tables, stored at row out_rows[b * S + s] of out (contiguous [R, H * D]); returns out.

    A program takes `rows` rows of `head_block` heads (a power of 2). Defaults from an H100 sweep
    (benchmarks/RESULTS.md 18, 2026-11-25; Qwen-Image's q, 2 x 6,889 rows of 24 x 128): 1 row of 4
    heads on 1 warp ran at 1.21x a plain copy of the bytes; 2 rows of all heads (32, masked) on 4
    warps at 5.9x.
    """
    batch, seq_len, dim = x.shape
    head_dim = weight.numel()
    heads = dim // head_dim
    head_block = min(head_block, triton.next_power_of_2(heads))
    grid = (triton.cdiv(seq_len, rows), batch, triton.cdiv(heads, head_block))
    _head_rms_norm_rope_kernel[grid](
        x,
        weight,
        cos if cos is not None else weight,
        sin if sin is not None else weight,
        out,
        out_rows,
        seq_len,
        x.stride(0),
        x.stride(1),
        eps,
        HEADS=heads,
        HEAD_BLOCK=head_block,
        HEAD_DIM=head_dim,
        ROWS=rows,
        HAS_ROPE=cos is not None,
        num_warps=num_warps,
    )
    return out
