"""silu(gate) * up (mmgen.layers.fused_activations): torch's ops on the CPU, one Triton pass on CUDA.

The CPU path is torch's F.silu(gate) * up itself (so the fp32 parity tests of the models that use it
hold unchanged): equal in bits. On CUDA the kernel computes in float32 and rounds once, so against a
float64 reference it is within float32 error in fp32 (1e-5 relative: exp and division as the GPU
computes them) and within half a unit in the last place of the result's dtype in bf16/fp16 (relative
2^-8 / 2^-11, plus float32 slack: FLOAT32_SLACK); torch rounds twice (silu's output, then the product), so the two
differ by at most three such half-units.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmgen.layers.fused_activations import silu_mul
from mmgen.layers.fused_norms import HAS_TRITON

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton"
)
# Unit roundoff of each dtype: round to nearest is within this relative distance of the exact value.
ROUNDOFF = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# The kernel's float32 value before its one rounding: exp and division as the GPU approximates them
# (exp(-g) to about |g| * 2^-24 relative, |g| < 20 here) can tip a value that sits by a rounding point.
FLOAT32_SLACK = 2.0**-16


def _inputs(shape, dtype, device, seed=0):
    """gate, up with values in about [-12, 12]: silu's tails and its curved middle both."""
    generator = torch.Generator().manual_seed(seed)
    gate = 4 * torch.randn(shape, generator=generator)
    up = torch.randn(shape, generator=generator)
    return gate.to(device, dtype), up.to(device, dtype)


def _within(got, want, rtol):
    """|got - want| <= rtol * |want| elementwise, plus the dtype's smallest normal (fp16's subnormal
    results round on an absolute grid)."""
    atol = torch.finfo(got.dtype).smallest_normal
    return ((got.double() - want.double()).abs() <= rtol * want.double().abs() + atol).all()


def _check_against_float64(got, gate, up):
    """got within the dtype's rounding of silu(gate) * up computed in float64 from the same inputs."""
    assert got.dtype == gate.dtype and got.shape == gate.shape and got.is_contiguous()
    assert _within(got, F.silu(gate.double()) * up.double(), ROUNDOFF[gate.dtype] + FLOAT32_SLACK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_is_torchs_ops(dtype):
    gate, up = _inputs((3, 5, 40), dtype, "cpu")
    assert torch.equal(silu_mul(gate, up), F.silu(gate) * up)
    assert torch.equal(silu_mul(gate, up, kernel=False), F.silu(gate) * up)


def test_mismatched_inputs_are_refused_by_name():
    gate, up = _inputs((2, 8), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"gate \(2, 8\).*up \(2, 7\)"):
        silu_mul(gate, up[:, :7])
    with pytest.raises(ValueError, match="must match"):
        silu_mul(gate, up.double())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(7, 12288), (2, 3, 1000), (5, 1), (0, 64)])
def test_cuda_kernel_matches_float64_reference(dtype, shape):
    gate, up = _inputs(shape, dtype, "cuda")
    got = silu_mul(gate, up)
    _check_against_float64(got, gate, up)
    torch_ops = silu_mul(gate, up, kernel=False)  # torch's ops on CUDA: two roundings in bf16/fp16
    assert torch.equal(torch_ops, F.silu(gate) * up)
    assert _within(got, torch_ops, 3 * ROUNDOFF[dtype] + FLOAT32_SLACK)


@needs_cuda
def test_cuda_kernel_reads_column_slices_in_place_and_keeps_silus_limits():
    """gate and up as column slices of one wider buffer (row stride != width); +-inf as torch gives them."""
    wide = 4 * torch.randn(300, 2 * 4096 + 64, device="cuda", dtype=torch.bfloat16)
    gate, up = wide[:, :4096], wide[:, 4096 + 64 :]
    _check_against_float64(silu_mul(gate, up), gate, up)
    edges = torch.tensor([[-1e30, -100.0, -0.0, 0.0, 100.0, float("inf"), float("-inf")]], device="cuda")
    ones = torch.ones_like(edges)
    torch.testing.assert_close(silu_mul(edges, ones), F.silu(edges), rtol=0, atol=0, equal_nan=True)
