"""FP8 self-attention (issue 20, item 4) on the CPU: per-(batch, head) quantization and the emulated path.

The FA3 FP8 kernel itself is checked against this emulation in test_fp8_gpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from wan_cases import TINY

from mmgen.attention.fp8 import Fp8Attention, check_fp8_attention, check_fp8_attention_impl, quantize_heads
from mmgen.attention.impls import SDPAImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanDiT
from pipelines.wan_t2v import WanT2VPipeline

REQUEST = dict(height=32, width=48, num_frames=5, num_inference_steps=3, guidance_scale=5.0, seed=11)
REQUEST["max_sequence_length"] = 16


def test_head_scales_match_an_independent_computation_and_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 3, 16, generator=g) * torch.tensor([0.01, 1.0, 100.0])[None, None, :, None]
    values, descale = quantize_heads(x)
    assert values.dtype == torch.float8_e4m3fn and descale.shape == (2, 3)
    expected = np.abs(x.numpy()).max(axis=(1, 3)) / 448
    np.testing.assert_allclose(descale.numpy(), expected, rtol=1e-6)
    back = values.float() * descale[:, None, :, None]
    bound = x.abs() / 16 + descale[:, None, :, None] * 2.0**-10
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())


def test_emulated_attention_is_close_and_checked():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 40, 2, 16, generator=g) for _ in range(3))
    exact = SDPAImpl()(q, k, v, AttentionMetadata())
    got = Fp8Attention(SDPAImpl())(q, k, v, AttentionMetadata())
    rel = float((got - exact).norm() / exact.norm())
    assert 1e-4 < rel < 0.08
    lengths = AttentionMetadata.from_lengths(None, torch.tensor([40, 30]))
    with pytest.raises(ValidationError, match="dense attention only"):
        Fp8Attention(SDPAImpl())(q, k, v, lengths)
    with pytest.raises(ValidationError, match="needs attention backend 'flash' with the FA3 provider"):
        check_fp8_attention_impl(SDPAImpl(), torch.device("cuda"))
    check_fp8_attention_impl(SDPAImpl(), torch.device("cpu"))  # emulated anywhere else
    assert check_fp8_attention(None) is None and check_fp8_attention(True) is True
    with pytest.raises(ValidationError, match="fp8_attention = 'on'"):
        check_fp8_attention("on")


def test_dit_self_attention_fp8_and_back():
    torch.manual_seed(0)
    model = WanDiT(TINY).eval()
    g = torch.Generator().manual_seed(5)
    latents, text = torch.randn(2, 4, 3, 8, 8, generator=g), torch.randn(2, 16, 32, generator=g)
    t = torch.tensor([500.0, 500.0])
    with torch.no_grad():
        reference = model(latents, t, text, attention=SDPAImpl())
        fp8 = ExecutionSettings(fp8_attention=True)
        lossy = model(latents, t, text, attention=SDPAImpl(), settings=fp8)
        back = model(latents, t, text, attention=SDPAImpl())
    assert torch.equal(back, reference)
    assert 1e-5 < float((lossy - reference).norm() / reference.norm()) < 0.05


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


def test_pipeline_option_recorded_and_off_is_todays_output(pipe):
    plain = pipe("a red circle", progress=False, **REQUEST)
    on = pipe("a red circle", progress=False, fp8_attention=True, fp8_linear=True, **REQUEST)
    assert on.args["fp8_attention"] is True and on.args["fp8_linear"] is True
    assert on.attention_providers["transformer.self_attn"].endswith(" e4m3")
    assert on.latents_sha256 != plain.latents_sha256
    again = pipe("a red circle", progress=False, fp8_attention=False, **REQUEST)
    assert again.frames_sha256 == plain.frames_sha256 and "fp8_attention" not in again.args
    assert again.attention_providers == plain.attention_providers


def test_fp8_attention_refuses_head_dims_outside_the_fa3_kernels_on_cuda():
    class Fa3Like:  # what the check reads of a FlashAttention impl with the FA3 provider
        name, provider = "flash", "fa3"

    check_fp8_attention_impl(Fa3Like(), torch.device("cuda"), 128)  # covered
    for head_dim in (32, 512):
        with pytest.raises(ValidationError, match=f"head dim {head_dim} is outside FA3's FP8 kernels"):
            check_fp8_attention_impl(Fa3Like(), torch.device("cuda"), head_dim)
    check_fp8_attention_impl(SDPAImpl(), torch.device("cpu"), 32)  # emulated on the CPU: any head dim
