"""FP8 linear layers on a GPU (issue 20): the Triton producers and torch._scaled_mm against the torch references.

Skips without CUDA, without Triton, or on a GPU without FP8 GEMMs (compute capability < 8.9).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from wan_cases import TINY

from mmgen.layers.fp8_linear import (
    FP8_LAYER_KINDS,
    fp8_linear,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
)
from mmgen.layers.fused_norms import layer_norm_modulate, residual_layer_norm

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    or importlib.util.find_spec("triton") is None
    or torch.cuda.get_device_capability() < (8, 9),
    reason="needs CUDA with FP8 GEMMs (compute capability >= 8.9) and Triton",
)


def _close_fp8(got, expected):
    """Two quantizations of (nearly) the same rows: scales within bf16 rounding, values within one e4m3 step."""
    torch.testing.assert_close(got.scales, expected.scales, rtol=1e-2, atol=0)
    a, b = got.dequantize(), expected.dequantize()
    step = expected.values.float().abs().clamp(min=2**-6) / 8 * expected.scales  # one ulp of e4m3
    assert bool(((a - b).abs() <= step * 1.1 + 1e-30).all())  # one step, plus scales within bf16 rounding


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("width", [1536, 8960, 13824])
def test_triton_quantize_matches_reference(gelu, width):
    x = torch.randn(3, 37, width, device="cuda", dtype=torch.bfloat16) * 3
    got = quantize_rows(x, gelu=gelu)
    expected = quantize_rows_reference(x, gelu=gelu)
    assert got.values.dtype == torch.float8_e4m3fn and got.scales.shape == (3, 37, 1)
    _close_fp8(got, expected)


def test_norm_kernels_fp8_output_match_reference():
    x = torch.randn(2, 100, 1536, device="cuda", dtype=torch.bfloat16)
    update = torch.randn_like(x)
    shift = torch.randn(2, 1, 1536, device="cuda")
    scale = torch.randn(2, 1, 1536, device="cuda")
    got = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, fp8=True)
    expected = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, kernel=False, fp8=True)
    _close_fp8(got, expected)
    x_new, h = residual_layer_norm(x, update, None, eps=1e-6, shift=shift, scale=scale, fp8=True)
    x_ref, h_ref = residual_layer_norm(
        x, update, None, eps=1e-6, shift=shift, scale=scale, kernel=False, fp8=True
    )
    torch.testing.assert_close(x_new, x_ref)
    _close_fp8(h, h_ref)


def test_scaled_mm_matches_the_emulation():
    x = torch.randn(300, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4608, 1536, device="cuda", dtype=torch.bfloat16) / 40
    b = torch.randn(4608, device="cuda", dtype=torch.bfloat16)
    qx, qw = quantize_rows(x), quantize_weight(w)
    got = fp8_linear(qx, qw, b, torch.bfloat16)
    emulated = (qx.dequantize() @ qw.values.float().mul(qw.scales[:, None]).t() + b.float()).to(
        torch.bfloat16
    )
    torch.testing.assert_close(got, emulated, rtol=2e-2, atol=2e-2)
    exact = x.float() @ w.float().t() + b.float()
    assert float((got.float() - exact).norm() / exact.norm()) < 0.05


def test_tiny_dit_fp8_close_to_bf16():
    from mmgen.attention.impls import SDPAImpl
    from mmgen.models.settings import ExecutionSettings
    from mmgen.models.wan import WanDiT

    torch.manual_seed(0)
    config = type(TINY)(
        **{**TINY.__dict__, "num_attention_heads": 2, "attention_head_dim": 64, "ffn_dim": 256}
    )
    model = WanDiT(config).to("cuda", torch.bfloat16).eval()
    latents = torch.randn(2, 4, 3, 8, 8, device="cuda")
    t = torch.tensor([500.0, 500.0], device="cuda")
    text = torch.randn(2, 16, 32, device="cuda")
    with torch.no_grad():
        reference = model(latents, t, text, attention=SDPAImpl()).float()
        fp8 = ExecutionSettings(fp8_layers=frozenset(FP8_LAYER_KINDS) - {"cross_kv"})
        lossy = model(latents, t, text, attention=SDPAImpl(), settings=fp8).float()
    assert float((lossy - reference).norm() / reference.norm()) < 0.08


def test_fa3_fp8_attention_matches_the_emulation():
    from mmgen.attention import select_attention
    from mmgen.attention.fp8 import Fp8Attention, dequantize_heads, quantize_heads
    from mmgen.attention.metadata import AttentionMetadata

    try:
        attention = select_attention("flash", device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128)
    except Exception as err:  # noqa: BLE001 - no FA3 here: nothing to compare
        pytest.skip(f"no FlashAttention provider: {err}")
    if attention.provider != "fa3":
        pytest.skip(f"FA3 not installed (provider {attention.provider})")
    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = Fp8Attention(attention)(q, k, v, AttentionMetadata())
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    emulated = attention(
        *(dequantize_heads(*quantize_heads(t), torch.bfloat16) for t in (q, k, v)), AttentionMetadata()
    )
    torch.testing.assert_close(got.float(), emulated.float(), rtol=3e-2, atol=3e-2)
    exact = attention(q, k, v, AttentionMetadata()).float()
    assert float((got.float() - exact).norm() / exact.norm()) < 0.08


def test_triton_head_quantize_matches_reference():
    from mmgen.attention.fp8 import quantize_heads

    x = torch.randn(2, 333, 12, 128, device="cuda", dtype=torch.bfloat16)
    x[1, :, 3] *= 50
    values, descale = quantize_heads(x)
    ref_values, ref_descale = quantize_heads(x, kernel=False)
    torch.testing.assert_close(descale, ref_descale)
    a = values.float() * descale[:, None, :, None]
    b = ref_values.float() * ref_descale[:, None, :, None]
    step = ref_values.float().abs().clamp(min=2**-6) / 8 * ref_descale[:, None, :, None]
    assert bool(((a - b).abs() <= step * 1.1).all())
