"""FP8 (e4m3) linear layers: weights quantized once per output channel, activations per row (issue 20).

y = (Xq * sx) (Wq * sw)^T + b, with Xq, Wq float8_e4m3fn, sx [M, 1] one float32 scale per token
row, sw [N] one per output channel (so a fused q/k/v stack quantizes exactly as its parts do).
Each scale is the row's absolute maximum / 448 (e4m3's largest finite value): the row's largest
entry lands on 448, nothing saturates.

Two implementations of one formula:
- CUDA, compute capability >= 8.9 (Hopper, Ada): torch._scaled_mm with row-wise scales, bf16 out,
  bias in the epilogue; activations come quantized from the kernel that produced them (the fused
  LayerNorm + modulation, mmgen.layers.fused_norms, `fp8=True`) or from one Triton pass that reads
  the bf16 activation (optionally applying the FFN's GELU first) and writes fp8 + scales
  (mmgen.layers.triton_fp8). Quantizing in a separate eager op made the layer 0.34-1.22x bf16 on an
  H200 (RESULTS.md), hence the fusion.
- elsewhere (the CPU tests): the same quantization in torch and the GEMM emulated in float32 on the
  dequantized operands.

Which layers of a Wan block use FP8 is data (FP8_LAYER_KINDS, FP8_LAYERS_BY_WIDTH), chosen per model
width from the per-shape table of benchmarks/RESULTS.md 12c. The quantized weights are cached per layer and re-made when the
weight tensor changes (its storage, device, dtype or in-place version: a fused LoRA, a move).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from mmgen.errors import ValidationError
from mmgen.layers.compile_guard import not_compiled, opaque_op
from mmgen.layers.low_rank import LowRankLinear, add_low_rank_terms

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# A zero row gets this amax, so its scale is positive and its values stay 0 (no 0/0).
MIN_AMAX = 1e-12
HAS_TRITON = importlib.util.find_spec("triton") is not None

# The linear layers of a Wan block, by kind (what produces their input decides what FP8 costs there):
#   self_qkv  self-attention q/k/v   input from the fused LayerNorm + modulation kernel (quantized there)
#   cross_q   cross-attention q      input from the fused residual + LayerNorm kernel (quantized there)
#   cross_kv  cross-attention k/v    input the text tokens (512 per prompt): one quantize pass
#   attn_out  both attentions' out   input the attention output: one Triton quantize pass
#   ffn_in    FFN up-projection      input from the fused residual + LayerNorm + modulation kernel
#   ffn_out   FFN down-projection    input the GELU: GELU + quantize in one Triton pass
FP8_LAYER_KINDS = ("self_qkv", "cross_q", "cross_kv", "attn_out", "ffn_in", "ffn_out")
# Which kinds `fp8_linear=True` runs in FP8, by the model's width (dim): measured per shape on one
# H100 (torch 2.11.0+cu130, triton 3.6, 2026-11-23; benchmarks/RESULTS.md 12c), a kind
# kept where producer + FP8 GEMM beat the bf16 layer by more than 2% at that width's CFG-step shapes.
#   dim 1536 (Wan2.1-1.3B, 65,520 token rows): self_qkv 1.29x, cross_q 1.17x; attn_out 0.89x,
#     ffn in+out 1.01x together, cross_kv 0.22x (1,024 text rows) stay bf16.
#   dim 5120 (Wan2.1/2.2-14B, 151,200 rows at 720p): self_qkv 1.37x, cross_q 1.28x, attn_out 1.38x,
#     ffn in+out 1.30x together; cross_kv 0.83x stays bf16.
# A width between or outside the measured ones takes the set of the largest measured width not
# above it (the narrower, measured-safe choice; below 1536, e.g. the embedded tiny model, the
# 1536 set). Unmeasured: dim 3072 (Wan2.2 TI2V-5B) therefore runs the 1536 set, though its
# GEMMs are 2x wider and may pay like 14B's; widths above 5120 take the 5120 set.
FP8_LAYERS_BY_WIDTH: tuple[tuple[int, frozenset[str]], ...] = (
    (1536, frozenset({"self_qkv", "cross_q"})),
    (5120, frozenset({"self_qkv", "cross_q", "attn_out", "ffn_in", "ffn_out"})),
)


def fp8_layers_for(dim: int) -> frozenset[str]:
    """The FP8 layer kinds for a DiT of width `dim` (FP8_LAYERS_BY_WIDTH: the largest measured width <= dim)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValidationError(f"model width {dim!r}: must be a positive integer")
    chosen = FP8_LAYERS_BY_WIDTH[0][1]
    for width, kinds in FP8_LAYERS_BY_WIDTH:
        if width <= dim:
            chosen = kinds
    return chosen


def fp8_block_bytes(dim: int, ffn_dim: int, kinds: Iterable[str]) -> int:
    """Device bytes of one Wan block's FP8 weight copies for these layer kinds: one byte per weight and a
    float32 scale per output channel (kept beside the bf16 weights while FP8 linears are on)."""
    shapes = {  # (in, out) of each kind's linears in one block
        "self_qkv": [(dim, dim)] * 3,
        "cross_q": [(dim, dim)],
        "cross_kv": [(dim, dim)] * 2,
        "attn_out": [(dim, dim)] * 2,
        "ffn_in": [(dim, ffn_dim)],
        "ffn_out": [(ffn_dim, dim)],
    }
    return sum(n_in * n_out + 4 * n_out for kind in check_fp8_layers(kinds) for n_in, n_out in shapes[kind])


def check_flag(value: Any, name: str) -> bool | None:
    """None (not given), True or False, as given; anything else is an error naming `name`."""
    if value is None or isinstance(value, bool):
        return value
    raise ValidationError(f"{name} = {value!r}: must be true, false or null")


def check_fp8_linear(value: Any, name: str = "fp8_linear") -> bool | None:
    """None or False (off) -> None; True (on) -> True; anything else is an error."""
    return True if check_flag(value, name) else None


def check_fp8_layers(kinds: Iterable[str]) -> frozenset[str]:
    """The set of layer kinds, each one of FP8_LAYER_KINDS (an unknown name is an error)."""
    kinds = frozenset(kinds)
    unknown = sorted(kinds - set(FP8_LAYER_KINDS))
    if unknown:
        raise ValidationError(f"FP8 layer kind(s) {unknown}: allowed values are {', '.join(FP8_LAYER_KINDS)}")
    return kinds


@dataclass(frozen=True)
class Fp8Activation:
    """A quantized activation: values float8_e4m3fn [..., K] and scales float32 [..., 1]; x ~= values * scales."""

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scales in float32, stored as `dtype`; [..., K]."""
        return (self.values.float() * self.scales).to(dtype)

    def narrow(self, dim: int, start: int, length: int) -> Fp8Activation:
        """The rows [start, start + length) along a leading dimension `dim` (not the last)."""
        return Fp8Activation(self.values.narrow(dim, start, length), self.scales.narrow(dim, start, length))


@dataclass(frozen=True)
class Fp8Weight:
    """A quantized weight: values float8_e4m3fn [N, K] (row-major) and per-output-channel scales float32 [N]."""

    values: torch.Tensor
    scales: torch.Tensor


def quantize_rows_reference(x: torch.Tensor, *, gelu: bool = False) -> Fp8Activation:
    """x [..., K] -> per-row Fp8Activation, in torch (float32 math); gelu applies tanh-GELU first."""
    x = x.float()
    if gelu:
        x = F.gelu(x, approximate="tanh")
    scales = x.abs().amax(dim=-1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    values = (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Activation(values, scales)


def quantize_rows(x: torch.Tensor, *, gelu: bool = False, kernel: bool = True) -> Fp8Activation:
    """x [..., K] (contiguous rows) -> Fp8Activation; on CUDA one Triton pass, else quantize_rows_reference."""
    if kernel and HAS_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        values, scales = _fp8_quantize_rows_cuda(x.contiguous(), gelu)
        return Fp8Activation(values, scales)
    return quantize_rows_reference(x, gelu=gelu)


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """weight [N, K] -> Fp8Weight with one scale per output channel (row of the weight)."""
    rows = quantize_rows_reference(weight)
    return Fp8Weight(rows.values.contiguous(), rows.scales.squeeze(-1).contiguous())


def fp8_gemm_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm's FP8 row-wise GEMM runs on `device` (CUDA, compute capability >= 8.9)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(
    x: torch.Tensor | Fp8Activation,
    weight: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """x [..., K] (a tensor, quantized here, or an Fp8Activation) -> x W^T + b [..., N] in out_dtype.

    On CUDA: torch._scaled_mm (row-wise scales need a bfloat16 output; check_fp8_device says
    whether the GPU has FP8 GEMMs). Elsewhere: float32 on the dequantized operands (the emulation
    the CPU tests run).
    """
    act = x if isinstance(x, Fp8Activation) else quantize_rows(x)
    lead = act.values.shape[:-1]
    values = act.values.reshape(-1, act.values.shape[-1])
    scales = act.scales.reshape(-1, 1)
    if values.is_cuda:
        if out_dtype != torch.bfloat16:
            raise ValidationError(
                f"fp8_linear on CUDA needs a bfloat16 model (row-wise FP8 GEMM), got {out_dtype}"
            )
        out = torch._scaled_mm(
            values,
            weight.values.t(),  # [K, N] column-major, as _scaled_mm wants its second operand
            scale_a=scales,
            scale_b=weight.scales.view(1, -1),
            bias=None if bias is None else bias.to(out_dtype),
            out_dtype=out_dtype,
        )
    else:
        dense = (weight.values.float() * weight.scales[:, None]).t()
        out = (values.float() * scales) @ dense
        if bias is not None:
            out = out + bias.float()
        out = out.to(out_dtype)
    return out.view(*lead, out.shape[-1])


class Fp8WeightCache:
    """Quantized weights by name, re-made when the source weight changes (storage, device, dtype or version).

    Owned by the module whose weights it holds (no global state); clear() drops the copies.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[tuple[Any, ...], Fp8Weight]] = {}

    @not_compiled  # storage and version checks are host-side bookkeeping, not graph ops (compile_guard)
    def get(self, name: str, weight: torch.Tensor) -> Fp8Weight:
        """The Fp8Weight of weight [N, K], quantized now unless the cached one is of this very tensor state."""
        key = (weight.data_ptr(), weight.device, weight.dtype, tuple(weight.shape), weight._version)
        entry = self._entries.get(name)
        if entry is None or entry[0] != key:
            entry = (key, quantize_weight(weight.detach()))
            self._entries[name] = entry
        return entry[1]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@opaque_op("mmgen::fp8_quantize_rows")
def _fp8_quantize_rows_cuda(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from mmgen.layers import triton_fp8  # optional: triton

    return triton_fp8.quantize_rows(x, gelu=gelu)


@_fp8_quantize_rows_cuda.register_fake
def _fp8_quantize_rows_shape(x, gelu):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


def dense(x: torch.Tensor | Fp8Activation, dtype: torch.dtype) -> torch.Tensor:
    """x itself, or a quantized activation's dequantized values in `dtype` (for a bf16 consumer)."""
    return x.dequantize(dtype) if isinstance(x, Fp8Activation) else x


def linear_fp8(
    layer: torch.nn.Linear, x: torch.Tensor | Fp8Activation, cache: Fp8WeightCache, name: str
) -> torch.Tensor:
    """layer(x) with its weight in FP8 (cached under `name`), in the weight's dtype; [..., K] -> [..., N].

    An unfused LoRA beside the layer (mmgen.layers.low_rank.LowRankLinear) adds its low-rank term
    in the weight's dtype, read from the dequantized input (low_rank.add_low_rank_terms).
    """
    y = fp8_linear(x, cache.get(name, layer.weight), layer.bias, layer.weight.dtype)
    if isinstance(layer, LowRankLinear):
        y = add_low_rank_terms(dense(x, y.dtype), y, (layer,))
    return y


def check_fp8_device(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse FP8 linears where they cannot run: on CUDA they need compute capability >= 8.9 and bf16.

    CPU (and other devices) run the float32 emulation, which takes any dtype.
    """
    if device.type != "cuda":
        return
    if not fp8_gemm_supported(device):
        raise ValidationError(
            f"fp8_linear needs a GPU with FP8 GEMMs (compute capability >= 8.9: Ada, Hopper), got "
            f"{torch.cuda.get_device_name(device)} ({'.'.join(map(str, torch.cuda.get_device_capability(device)))})"
        )
    if dtype != torch.bfloat16:
        raise ValidationError(f"fp8_linear needs a bfloat16 model on CUDA (row-wise FP8 GEMM), got {dtype}")
