"""The Wan DiT's fast paths: RoPE tables, one-pass fp32 modulation/gating, and compile_blocks (CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from mmgen.attention import SDPAImpl
from mmgen.layers.modulation import gated_residual, modulate, modulate_as
from mmgen.layers.rotary import apply_rope, rope_3d_tables
from mmgen.loading.wan_transformer import wan_dit_from_tensors
from mmgen.models.wan import WanConfig

TINY = WanConfig(
    num_attention_heads=2,
    attention_head_dim=16,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=3,
    rope_max_seq_len=32,
    text_len=16,
)


def rotate_pairs_complex(x: torch.Tensor, grid: tuple[int, int, int], theta: float = 10000.0) -> torch.Tensor:
    """Independent RoPE: pairs as complex numbers times exp(i * angle), Wan's frame/height/width split, float64."""
    head_dim = x.shape[-1]
    spatial = 2 * (head_dim // 6)
    dims = (head_dim - 2 * spatial, spatial, spatial)
    positions = torch.cartesian_prod(*(torch.arange(n, dtype=torch.float64) for n in grid))  # [S, 3]
    angles = []
    for axis, dim in enumerate(dims):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles.append(positions[:, axis : axis + 1] * inv_freq)
    angle = torch.cat(angles, dim=-1)[None, :, None, :]  # [1, S, 1, D/2]
    pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


@pytest.mark.parametrize("grid", [(1, 4, 6), (3, 2, 5)])
def test_rope_matches_complex_rotation(grid):
    head_dim, heads = 24, 3
    x = torch.randn(2, math.prod(grid), heads, head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_3d_tables(grid, head_dim, device="cpu")
    assert cos.shape == sin.shape == (1, math.prod(grid), 1, head_dim) and cos.dtype == torch.float32
    out = apply_rope(x, cos, sin)
    assert out.dtype == x.dtype
    assert (out.double() - rotate_pairs_complex(x, grid)).abs().max().item() <= 1e-5
    # bf16 input: computed in fp32, rounded once to bf16
    x16 = x.bfloat16()
    expected = rotate_pairs_complex(x16.float(), grid).to(torch.bfloat16)
    got = apply_rope(x16, cos, sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-8, atol=1e-6)


def test_one_pass_modulation_and_gating_round_once():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 16, generator=gen).bfloat16()
    update = torch.randn(2, 7, 16, generator=gen).bfloat16()
    gate, shift, scale = (torch.randn(2, 1, 16, generator=gen) for _ in range(3))
    normed = torch.randn(2, 7, 16, generator=gen)
    residual = gated_residual(x, update, gate)
    assert residual.dtype == torch.bfloat16
    expected = (x.double() + update.double() * gate.double()).to(torch.bfloat16)
    torch.testing.assert_close(residual.float(), expected.float(), rtol=2**-8, atol=1e-6)
    modulated = modulate_as(normed, shift, scale, torch.bfloat16)
    assert modulated.dtype == torch.bfloat16
    expected = modulate(normed.double(), shift.double(), scale.double()).to(torch.bfloat16)
    torch.testing.assert_close(modulated.float(), expected.float(), rtol=2**-8, atol=1e-6)


def test_compile_blocks_same_output_no_recompile():
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**TINY.to_diffusers_config()).eval()
    state = {name: (t, Path("<test>")) for name, t in reference.state_dict().items()}
    model = wan_dit_from_tensors(TINY, state, source=Path("<test>"), dtype=torch.float32, device="cpu")
    keys = list(model.state_dict())
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(2, 4, 3, 4, 6, generator=gen)
    text = torch.randn(2, TINY.text_len, TINY.text_dim, generator=gen)
    with torch.no_grad():
        eager = model(latents, torch.tensor([999.0, 999.0]), text, attention=SDPAImpl())
        torch._dynamo.reset()
        model.compile_blocks(backend="aot_eager")
        compiled = model(latents, torch.tensor([999.0, 999.0]), text, attention=SDPAImpl())
        # new timestep values, fresh metadata and a fresh impl object: the compiled blocks are reused
        with torch._dynamo.config.patch(error_on_recompile=True):
            later = model(latents, torch.tensor([500.0, 500.0]), text, attention=SDPAImpl())
        expected = reference(latents, torch.tensor([500.0, 500.0]), text, return_dict=False)[0]
    torch._dynamo.reset()
    assert list(model.state_dict()) == keys  # compiling in place keeps the checkpoint names
    assert (compiled - eager).abs().max().item() <= 1e-6
    assert (later - expected).abs().max().item() <= 1e-5
