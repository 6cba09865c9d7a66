"""One-pass row operations of the DiT block: residual + LayerNorm + modulation, q/k RMSNorm + RoPE, residuals.

Each function has two implementations of one formula: a torch reference (the CPU path, and the
oracle of the GPU tests) and, on CUDA where Triton imports, one Triton kernel that reads each input
once and writes each output once (mmgen.layers.triton_norms). Eager torch runs these as 3-8 kernels
with float32 intermediates in memory; inductor fuses them but, for rows longer than 1024, as looped
reductions that run at about half the memory bandwidth. The kernels compute in float32 and round
each output once; the references round where the unfused model does (e.g. after RMSNorm, before
RoPE), so the two differ by bf16 rounding only.

Modulation vectors (shift, scale, gate) are tables [N, 1, D] float32 (mmgen.layers.modulation): row b
for sample b, or, given `token_rows` [B, S] (one timestep per token, Wan2.2 TI2V), row token_rows[b, s]
for token (b, s). The kernels index the table per token; the references gather it.

The kernels are registered as torch custom ops (namespace `mmgen`, CUDA only) so torch.compile
treats them as opaque calls with known output shapes instead of tracing into Triton launches.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch
import torch.nn.functional as F

from mmgen.layers.compile_guard import opaque_op
from mmgen.layers.fp8_linear import Fp8Activation, quantize_rows_reference
from mmgen.layers.modulation import check_token_rows, gated_residual, modulate_as, token_vectors
from mmgen.layers.rotary import apply_rope

HAS_TRITON = importlib.util.find_spec("triton") is not None
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_norms() -> ModuleType:
    """mmgen.layers.triton_norms, imported on the first CUDA call: it imports triton (optional)."""
    from mmgen.layers import triton_norms

    return triton_norms


def kernel_applies(x: torch.Tensor, enabled: bool) -> bool:
    """Whether the Triton kernel runs for x: enabled, a CUDA tensor of a kernel dtype, and Triton importable."""
    return enabled and HAS_TRITON and x.is_cuda and x.dtype in KERNEL_DTYPES


def _unit_stride(vector: torch.Tensor | None) -> torch.Tensor | None:
    # The kernels index vector tables [N, 1, D] by their row stride and unit column stride.
    return vector if vector is None or vector.stride(-1) == 1 else vector.contiguous()


# ----------------------------------------------------------------------------------------------
# LayerNorm (+ residual) (+ modulation)


def layer_norm_modulate(
    x: torch.Tensor,
    *,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    kernel: bool = True,
    fp8: bool = False,
    token_rows: torch.Tensor | None = None,
    spare_columns: int = 0,
) -> torch.Tensor | Fp8Activation:
    """LayerNorm(x) (* weight + bias) (* (1 + scale) + shift) in float32, stored in x's dtype.

    x [B, S, D]; weight/bias float [D] or None; shift/scale float32 [B, 1, D] or None (both or neither),
    or tables [N, 1, D] with token_rows int [B, S] (token (b, s) reads row token_rows[b, s]).
    fp8: return it quantized per row instead (Fp8Activation, the input of an FP8 linear); the kernel
    quantizes the float32 result, the reference its x-dtype rounding (within that rounding).
    spare_columns: return a [B, S, D + spare_columns] buffer with the result in its first D columns
    and the rest uninitialized (scratch for the "concat" LoRA kernel, mmgen.layers.low_rank).
    """
    check_token_rows(x, token_rows)
    _check_spare(spare_columns, fp8)
    if kernel_applies(x, kernel):
        args = (x.contiguous(), weight, bias, _unit_stride(shift), _unit_stride(scale), eps, token_rows)
        if fp8:
            return Fp8Activation(*_layer_norm_modulate_fp8_cuda(*args))
        return _layer_norm_modulate_cuda(*args, spare_columns)
    out = _layer_norm_modulate_reference(x, weight, bias, shift, scale, eps, token_rows)
    return quantize_rows_reference(out) if fp8 else _padded(out, spare_columns)


def residual_layer_norm(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor | None,
    *,
    eps: float,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    shift: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    kernel: bool = True,
    fp8: bool = False,
    token_rows: torch.Tensor | None = None,
    spare_columns: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]:
    """(x_new, layer_norm_modulate(x_new)) with x_new = x + update (* gate), float32 math, stored in x's dtype.

    x, update [B, S, D]; gate float32 [B, 1, D] or None (a plain residual add), or a table [N, 1, D]
    read through token_rows like shift/scale; the rest as in layer_norm_modulate (fp8 and
    spare_columns included: the normed output gets the spare columns, x_new none). The norm reads
    x_new as stored (rounded), as the unfused model does.
    """
    check_token_rows(x, token_rows)
    _check_spare(spare_columns, fp8)
    if kernel_applies(x, kernel):
        args = (
            x.contiguous(),
            update.contiguous(),
            _unit_stride(gate),
            weight,
            bias,
            _unit_stride(shift),
            _unit_stride(scale),
            eps,
            token_rows,
        )
        if fp8:
            x, values, scales = _residual_layer_norm_fp8_cuda(*args)
            return x, Fp8Activation(values, scales)
        return _residual_layer_norm_cuda(*args, spare_columns)
    x = _residual_reference(x, update, gate, token_rows)
    out = _layer_norm_modulate_reference(x, weight, bias, shift, scale, eps, token_rows)
    return x, quantize_rows_reference(out) if fp8 else _padded(out, spare_columns)


def _check_spare(spare_columns: int, fp8: bool) -> None:
    if spare_columns < 0 or (spare_columns and fp8):
        raise ValueError(f"spare_columns={spare_columns}: must be >= 0, and 0 with fp8 output")


def _padded(out: torch.Tensor, spare_columns: int) -> torch.Tensor:
    """out [B, S, D] in a [B, S, D + spare_columns] buffer (the reference path's copy of the kernel's layout)."""
    if not spare_columns:
        return out
    buffer = out.new_empty(*out.shape[:-1], out.shape[-1] + spare_columns)
    buffer[..., : out.shape[-1]] = out
    return buffer


def add_residual(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor | None,
    *,
    kernel: bool = True,
    token_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """x + update (* gate) in float32, stored in x's dtype; x, update [B, S, D], gate float32 [B, 1, D] or None
    (or a table [N, 1, D] read through token_rows [B, S], as in layer_norm_modulate).

    Eager torch runs the gated form as one addcmul, but a slow one (type promotion and a broadcast
    operand: about a quarter of the copy bandwidth on an H200); the kernel runs near it.
    """
    check_token_rows(x, token_rows)
    if kernel_applies(x, kernel):
        return _add_residual_cuda(x.contiguous(), update.contiguous(), _unit_stride(gate), token_rows)
    return _residual_reference(x, update, gate, token_rows)


def _residual_reference(
    x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None, token_rows: torch.Tensor | None
) -> torch.Tensor:
    if gate is None:
        return x + update
    return gated_residual(x, update, token_vectors(gate, token_rows))


def _layer_norm_modulate_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    token_rows: torch.Tensor | None,
) -> torch.Tensor:
    weight = None if weight is None else weight.float()
    bias = None if bias is None else bias.float()
    normed = F.layer_norm(x.float(), x.shape[-1:], weight, bias, eps)
    if shift is None:
        return normed.to(x.dtype)
    return modulate_as(normed, token_vectors(shift, token_rows), token_vectors(scale, token_rows), x.dtype)


@opaque_op("mmgen::layer_norm_modulate")
def _layer_norm_modulate_cuda(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    token_rows: torch.Tensor | None,
    spare_columns: int = 0,
) -> torch.Tensor:
    return _triton_norms().residual_layer_norm(
        x, None, None, weight, bias, shift, scale, eps, token_rows=token_rows, spare_columns=spare_columns
    )[1]


@_layer_norm_modulate_cuda.register_fake
def _layer_norm_modulate_shape(x, weight, bias, shift, scale, eps, token_rows, spare_columns=0):
    return x.new_empty(*x.shape[:-1], x.shape[-1] + spare_columns)


@opaque_op("mmgen::residual_layer_norm")
def _residual_layer_norm_cuda(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    token_rows: torch.Tensor | None,
    spare_columns: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_norms().residual_layer_norm(
        x, update, gate, weight, bias, shift, scale, eps, token_rows=token_rows, spare_columns=spare_columns
    )


@_residual_layer_norm_cuda.register_fake
def _residual_layer_norm_shape(x, update, gate, weight, bias, shift, scale, eps, token_rows, spare_columns=0):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(*x.shape[:-1], x.shape[-1] + spare_columns),
    )


@opaque_op("mmgen::add_residual")
def _add_residual_cuda(
    x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor | None, token_rows: torch.Tensor | None
) -> torch.Tensor:
    return _triton_norms().residual_layer_norm(
        x, update, gate, None, None, None, None, 0.0, norm=False, token_rows=token_rows
    )[0]


@_add_residual_cuda.register_fake
def _add_residual_shape(x, update, gate, token_rows):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fp8_scales(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


@opaque_op("mmgen::layer_norm_modulate_fp8")
def _layer_norm_modulate_fp8_cuda(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    token_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scales = _fp8_scales(x)
    out = _triton_norms().residual_layer_norm(
        x, None, None, weight, bias, shift, scale, eps, fp8_scales=scales, token_rows=token_rows
    )[1]
    return out, scales


@_layer_norm_modulate_fp8_cuda.register_fake
def _layer_norm_modulate_fp8_shape(x, weight, bias, shift, scale, eps, token_rows):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), _fp8_scales(x)


@opaque_op("mmgen::residual_layer_norm_fp8")
def _residual_layer_norm_fp8_cuda(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    shift: torch.Tensor | None,
    scale: torch.Tensor | None,
    eps: float,
    token_rows: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scales = _fp8_scales(x)
    x_out, out = _triton_norms().residual_layer_norm(
        x, update, gate, weight, bias, shift, scale, eps, fp8_scales=scales, token_rows=token_rows
    )
    return x_out, out, scales


@_residual_layer_norm_fp8_cuda.register_fake
def _residual_layer_norm_fp8_shape(x, update, gate, weight, bias, shift, scale, eps, token_rows):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
        _fp8_scales(x),
    )


# ----------------------------------------------------------------------------------------------
# RMSNorm across heads (+ RoPE)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    heads: int,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernel: bool = True,
) -> torch.Tensor:
    """RMSNorm over the whole row of x [B, S, D] times weight [D], split into heads, then RoPE -> [B, S, H, D/H].

    x may be a column slice of a wider projection (unit column stride); the result is contiguous
    in x's dtype. rope: (cos_full, sin_signed) float32 [1, S, 1, D/H] from rope_3d_tables, or None.
    """
    if kernel_applies(x, kernel):
        cos, sin = (None, None) if rope is None else (rope[0].contiguous(), rope[1].contiguous())
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = _rms_norm_rope_cuda(x, weight, eps, cos, sin, x.shape[-1] // heads)
        return out.unflatten(2, (heads, -1))
    normed = F.rms_norm(x, x.shape[-1:], weight, eps).unflatten(2, (heads, -1))
    return normed if rope is None else apply_rope(normed, *rope)


@opaque_op("mmgen::rms_norm_rope")
def _rms_norm_rope_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    head_dim: int,
) -> torch.Tensor:
    return _triton_norms().rms_norm_rope(x, weight, eps, cos, sin, head_dim)


@_rms_norm_rope_cuda.register_fake
def _rms_norm_rope_shape(x, weight, eps, cos, sin, head_dim):
    return x.new_empty(x.shape)


# ----------------------------------------------------------------------------------------------
# RMSNorm per head (+ RoPE), scattered into the rows of a joint sequence


def head_rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor,
    out_rows: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    kernel: bool = True,
) -> torch.Tensor:
    """RMSNorm of each head of x [B, S, H * D] times weight [D], then RoPE, written to rows of out.

    Token (b, s) lands in row out_rows[b * S + s] (int64 [B * S]) of out, a contiguous [R, H * D]
    tensor in x's dtype (the joint q or k rows of an MMDiT block: one pass from the projection's
    output to the attention input, no separate join). x may be a column slice of a wider projection
    (unit column stride). rope: (cos_full, sin_signed) float32 [S, D] tables, or None. Returns out.
    """
    head_dim = weight.numel()
    if x.shape[-1] % head_dim or out.shape[-1] != x.shape[-1] or not out.is_contiguous():
        raise ValueError(
            f"head_rms_norm_rope: x {tuple(x.shape)} into out {tuple(out.shape)} (contiguous) "
            f"with heads of {head_dim}"
        )
    if kernel_applies(x, kernel) and head_dim & (head_dim - 1) == 0:
        cos, sin = (None, None) if rope is None else (rope[0].contiguous(), rope[1].contiguous())
        x = x if x.stride(-1) == 1 else x.contiguous()
        _head_rms_norm_rope_cuda(x, weight, eps, cos, sin, out, out_rows)
        return out
    heads = x.unflatten(-1, (-1, head_dim)).float()
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if rope is not None:
        normed = apply_rope(normed, rope[0][None, :, None], rope[1][None, :, None])
    out.index_copy_(0, out_rows, normed.flatten(2).flatten(0, 1).to(out.dtype))
    return out


@opaque_op("mmgen::head_rms_norm_rope", mutates_args=("out",))
def _head_rms_norm_rope_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    out: torch.Tensor,
    out_rows: torch.Tensor,
) -> None:
    _triton_norms().head_rms_norm_rope(x, weight, eps, cos, sin, out, out_rows)
