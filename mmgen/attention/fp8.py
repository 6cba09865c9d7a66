"""FP8 (e4m3) self-attention through FA3's FP8 forward (issue 20 item 4), lossy, off by default.

fa3-fwd 0.0.3 (and flash-attention's hopper/ build) take float8_e4m3fn q/k/v with float32
descales [B, H_kv] (`q_descale`, `k_descale`, `v_descale`) and return bf16. `Fp8Attention` wraps an
attention impl: it quantizes q, k and v with one scale per (batch, head) (that head's absolute
maximum over all its tokens / 448) and calls the FA3 kernel; elsewhere (CPU, the tests) it runs
the wrapped impl on the dequantized tensors, the same numbers up to the kernel's own rounding.
On CUDA the wrapped impl must be FlashAttention with the FA3 provider; anything else is an error,
so the provider a result reports is the kernel that ran.

The quantization is two passes per tensor (a torch amax reduction, then one Triton scaled cast;
benchmarks/RESULTS.md 12d measured it beside the kernel); it runs on the dense self-attention
only (WanBlock; the text cross-attention keeps bf16).
"""

from __future__ import annotations

import torch

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import FP8_DTYPE, FP8_MAX, HAS_TRITON, MIN_AMAX, check_fp8_linear


def quantize_heads(x: torch.Tensor, *, kernel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, H, D] -> (float8_e4m3fn [B, S, H, D], descale float32 [B, H]) with x ~= values * descale.

    The amax is one reduction (no |x| temporary); on CUDA the scaled cast is one Triton pass
    (mmgen.layers.triton_fp8.scale_heads), elsewhere float32 torch.
    """
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=(1, 3)).float()
    descale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    if kernel and HAS_TRITON and x.is_cuda:
        from mmgen.layers import triton_fp8  # optional: triton

        return triton_fp8.scale_heads(x.contiguous(), 1.0 / descale), descale
    values = (x.float() / descale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values, descale


def dequantize_heads(values: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [B, S, H, D] * descale [B, H] in float32, stored as dtype."""
    return (values.float() * descale[:, None, :, None]).to(dtype)


# fa3-fwd 0.0.3's e4m3 forward kernels cover these head dims (RESULTS.md 12d).
FP8_HEAD_DIMS = (64, 256)


def check_fp8_attention_impl(
    attention: AttentionImpl, device: torch.device, head_dim: int | None = None
) -> None:
    """On CUDA the impl must be FlashAttention with the FA3 provider (the kernel with an FP8 forward),
    and the head dim one its FP8 kernels cover."""
    if device.type != "cuda":
        return
    if not (attention.name == "flash" and attention.provider == "fa3"):
        raise ValidationError(
            f"fp8_attention needs attention backend 'flash' with the FA3 provider (pip install fa3-fwd) "
            f"on CUDA, got {attention.name}:{attention.provider}"
        )
    low, high = FP8_HEAD_DIMS
    if head_dim is not None and not low <= head_dim <= high:
        raise ValidationError(
            f"fp8_attention: head dim {head_dim} is outside FA3's FP8 kernels ({low}-{high}); turn it off"
        )


class Fp8Attention:
    """An AttentionImpl: `inner`'s attention on e4m3 q/k/v with per-(batch, head) scales; dense metadata only."""

    def __init__(self, inner: AttentionImpl) -> None:
        self.inner = inner
        self.name = inner.name
        self.provider = f"{inner.provider} e4m3"

    def __repr__(self) -> str:
        return f"Fp8Attention({self.inner!r})"

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [B, Sq, H, D], k/v [B, Sk, H, D] -> [B, Sq, H, D] in q's dtype."""
        if meta.cu_seqlens_q is not None or meta.cu_seqlens_k is not None:
            raise ValidationError("fp8_attention runs dense attention only (metadata with cu_seqlens given)")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        (q8, qd), (k8, kd), (v8, vd) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
        if q.is_cuda:
            check_fp8_attention_impl(self.inner, q.device, q.shape[-1])
            out = self.inner.kernel.flash_attn_func(
                q8, k8, v8, softmax_scale=scale, causal=False, q_descale=qd, k_descale=kd, v_descale=vd
            )
            return out.to(q.dtype)
        dequantized = (dequantize_heads(t, d, q.dtype) for t, d in ((q8, qd), (k8, kd), (v8, vd)))
        return self.inner(*dequantized, meta, scale=scale)


def check_fp8_attention(value: object) -> bool | None:
    """None or False (off) -> None; True (on) -> True; anything else is an error."""
    return check_fp8_linear(value, "fp8_attention")
