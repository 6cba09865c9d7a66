"""The unfused LoRA kernels (mmgen.layers.low_rank) compute one formula: each equals the others and a
float64 reference (fp32, <= 1e-5 of the outputs' magnitude), on single layers, stacked q/k/v groups (with a layer that carries
no LoRA) and the FFN's GELU; without LoRA the stacked path is F.linear byte for byte. The Triton
epilogue kernel is checked against the cuBLAS path on CUDA only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lora_cases import TINY, diffusers_lora, relative_error
from lora_cases import low_rank_reference as _reference
from torch import nn

from mmgen.attention import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.layers.low_rank import (
    LOW_RANK_KERNELS,
    LowRankLinear,
    _stacked_up,
    _triton_up,
    low_rank_linear,
    set_low_rank_kernel,
)
from mmgen.lora import LoRARequest, apply_loras, parse_lora
from mmgen.lora.readers import LoRAFile
from mmgen.models.wan import WanDiT

# The kernels run one formula through differently shaped GEMMs (and the reference in float64): fp32
# rounding, a few ulps per op in an order each CPU's BLAS picks. 1e-5 absolute on the tiny DiT's O(1)
# outputs; on the stacked groups, whose outputs reach ~20, 1e-5 of the largest (relative_error):
# measured ~1e-7 of it. A dropped or misplaced LoRA term is O(1) relative.
TOLERANCE = 1e-5


def _group(seed: int, with_lora=(True, False, True), rank: int = 3, dtype=torch.float32, device="cpu"):
    """Three Linear(12 -> 8) layers (some with a LoRA), their stacked weight and bias, an input."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for index, lora in enumerate(with_lora):
        base = nn.Linear(12, 8)
        with torch.no_grad():
            base.weight.copy_(torch.randn(8, 12, generator=gen))
            base.bias.copy_(torch.randn(8, generator=gen))
        base = base.to(device=device, dtype=dtype)
        if lora:
            down = torch.randn(rank + index, 12, generator=gen).to(device=device, dtype=dtype)
            up = torch.randn(8, rank + index, generator=gen).to(device=device, dtype=dtype)
            base = LowRankLinear(base, down, up)
        layers.append(base)
    weight = torch.cat([layer.weight.detach() for layer in layers])
    bias = torch.cat([layer.bias.detach() for layer in layers])
    x = torch.randn(2, 5, 12, generator=gen).to(device=device, dtype=dtype)
    return layers, weight, bias, x


@pytest.mark.parametrize("kernel", LOW_RANK_KERNELS)
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_each_kernel_equals_the_reference_on_a_stacked_group(kernel, activation):
    layers, weight, bias, x = _group(0)
    for layer in layers:
        if isinstance(layer, LowRankLinear):
            layer.kernel = kernel
    with torch.no_grad():
        got = low_rank_linear(x, weight, bias, layers, activation)
        single = layers[0](x, activation)
    expected = _reference(layers, x, activation)
    assert got.shape == (2, 5, 24) and got.dtype == torch.float32
    assert relative_error(got, expected) <= TOLERANCE
    assert relative_error(single, _reference(layers[:1], x, activation)) <= TOLERANCE


def test_stacked_up_is_block_diagonal_and_gives_the_same_sum():
    layers, weight, bias, x = _group(1)
    up = _stacked_up(layers, 24, 3 + 5, like=layers[0].lora_up)
    assert up.shape == (24, 8)
    assert torch.equal(up[0:8, 0:3], layers[0].lora_up) and torch.equal(up[16:24, 3:8], layers[2].lora_up)
    assert up[8:16].abs().sum().item() == 0 and up[0:8, 3:].abs().sum().item() == 0
    down = torch.cat([layers[0].lora_down, layers[2].lora_down])
    with torch.no_grad():
        got = F.linear(x, weight, bias) + F.linear(F.linear(x, down), up)
    assert relative_error(got, _reference(layers, x)) <= TOLERANCE


def test_triton_up_groups_equal_layers_and_its_indexing_gives_the_same_sum():
    layers, weight, bias, x = _group(4, with_lora=(True, True, True), rank=4)
    assert _triton_up(layers, 24, 4 + 5 + 6, layers[0].lora_up)[1] is None  # ranks differ: block-diagonal
    gen = torch.Generator().manual_seed(5)
    wide = [
        LowRankLinear(
            nn.Linear(16, 256), torch.randn(4, 16, generator=gen), torch.randn(256, 4, generator=gen)
        )
    ]
    wide += [
        LowRankLinear(
            nn.Linear(16, 256), torch.randn(4, 16, generator=gen), torch.randn(256, 4, generator=gen)
        )
    ]
    up, group_cols = _triton_up(wide, 512, 8, wide[0].lora_up)
    assert group_cols == 256 and up.shape == (512, 4)
    x = torch.randn(7, 16, generator=gen)
    low = F.linear(x, torch.cat([layer.lora_down for layer in wide]))
    # The kernels' indexing: output column n uses low's rank columns of group n // group_cols.
    got = torch.cat([low[:, g * 4 : (g + 1) * 4] @ up[g * 256 : (g + 1) * 256].t() for g in range(2)], dim=1)
    expected = torch.cat([layer.low_rank(x) for layer in wide], dim=1)
    assert relative_error(got, expected) <= TOLERANCE


def test_without_lora_the_stacked_path_is_f_linear_bitwise():
    layers, weight, bias, x = _group(2, with_lora=(False, False, False))
    with torch.no_grad():
        assert torch.equal(low_rank_linear(x, weight, bias, layers), F.linear(x, weight, bias))
        gelu = low_rank_linear(x, weight, bias, layers, "gelu_tanh")
        assert torch.equal(gelu, F.gelu(F.linear(x, weight, bias), approximate="tanh"))


def test_bad_kernel_and_activation_are_errors():
    layers, weight, bias, x = _group(3)
    with pytest.raises(ValidationError, match="allowed auto, shared-down, fused-add, concat"):
        set_low_rank_kernel(nn.Sequential(*layers), "cutlass")
    with pytest.raises(ValidationError, match="low-rank kernel 'x'"):
        LowRankLinear(nn.Linear(4, 4), torch.zeros(1, 4), torch.zeros(4, 1), kernel="x")
    with pytest.raises(ValidationError, match="activation 'relu'"):
        low_rank_linear(x, weight, bias, layers, "relu")


@pytest.mark.parametrize("fuse_qkv", [False, True])
def test_model_output_is_the_same_for_every_kernel_and_equals_fused(fuse_qkv):
    torch.manual_seed(0)
    model = WanDiT(TINY).eval()
    if fuse_qkv:
        model.fuse_projections()
    state, metadata = diffusers_lora(model, rank=4)
    lora = LoRAFile(Path("mem"), "0" * 64, parse_lora(state, metadata, source="mem"))
    gen = torch.Generator().manual_seed(1)
    x = (
        torch.randn(1, 4, 3, 4, 6, generator=gen),
        torch.tensor([700.0]),
        torch.randn(1, 16, 32, generator=gen),
    )
    outputs = {}
    with torch.no_grad():
        applied = apply_loras([model], [(LoRARequest(lora.path, 0.7), lora)], mode="unfused")
        assert set_low_rank_kernel(model, "shared-down") == 2 * 10  # every block Linear, both layers
        for kernel in LOW_RANK_KERNELS:
            set_low_rank_kernel(model, kernel)
            outputs[kernel] = model(*x, attention=SDPAImpl())
        applied.remove()
        applied = apply_loras([model], [(LoRARequest(lora.path, 0.7), lora)], mode="fused")
        fused = model(*x, attention=SDPAImpl())
        applied.remove()
    for kernel, out in outputs.items():
        assert (out - outputs["shared-down"]).abs().max().item() <= TOLERANCE, kernel
        assert (out - fused).abs().max().item() <= TOLERANCE, kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
@pytest.mark.parametrize("shape", [(300, 192, 128, 32, 1), (129, 200, 96, 40, 1), (300, 768, 128, 32, 3)])
def test_epilogue_kernel_matches_cublas_path_on_cuda(activation, shape):
    pytest.importorskip("triton")
    from mmgen.layers.triton_low_rank import linear_plus_low_rank

    M, N, K, R, groups = shape  # ragged sizes too; groups > 1: stacked layers of N / groups outputs each
    gen = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    x, weight, bias = torch.randn(M, K, **kw), torch.randn(N, K, **kw) * K**-0.5, torch.randn(N, **kw)
    low, up = torch.randn(M, groups * R, **kw), torch.randn(N, R, **kw) * 0.1
    width = N // groups
    got = linear_plus_low_rank(x, weight, bias, low, up, activation, width if groups > 1 else None).float()
    term = torch.cat(
        [
            low[:, g * R : (g + 1) * R].float() @ up[g * width : (g + 1) * width].float().t()
            for g in range(groups)
        ],
        dim=1,
    )
    exact = F.linear(x.float(), weight.float(), bias.float()) + term
    if activation:
        exact = F.gelu(exact, approximate="tanh")
    # One bf16 rounding of the output (the cuBLAS path rounds twice): relative 2^-8 of the magnitude.
    assert ((got - exact).abs() / (exact.abs() + 1.0)).max().item() <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("activation", [None, "gelu_tanh"])
def test_fused_add_kernel_matches_addmm_on_cuda(activation):
    pytest.importorskip("triton")
    from mmgen.layers.triton_low_rank import add_low_rank_

    gen = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, generator=gen)
    y, low, up = torch.randn(333, 200, **kw), torch.randn(333, 40, **kw), torch.randn(200, 40, **kw) * 0.1
    exact = y.float() + low.float() @ up.float().t()
    if activation:
        exact = F.gelu(exact, approximate="tanh")
    got = add_low_rank_(y.clone(), low, up, activation).float()
    assert ((got - exact).abs() / (exact.abs() + 1.0)).max().item() <= 1e-2
