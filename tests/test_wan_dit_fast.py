"""The Wan DiT's fast paths: RoPE tables, one-pass fp32 modulation/gating, compile_blocks, stacked
projections, the pipeline's compile flag (CPU), and the Triton row kernels against their torch references (CUDA)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel
from wan_cases import TINY

from mmgen.attention import SDPAImpl
from mmgen.layers.modulation import gated_residual, modulate, modulate_as
from mmgen.layers.rotary import apply_rope, rope_3d_tables
from mmgen.loading.wan_transformer import wan_dit_from_tensors


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
    # Compiling stacks q/k/v (one GEMM three times as wide) and runs decomposed ops: fp32 rounding of
    # other shapes, a few ulps of these O(1) outputs on a CPU whose BLAS picks another kernel per shape
    # (equal on the dev machine); 1e-5 is the parity tolerance, far below what a wrong graph changes.
    assert (compiled - eager).abs().max().item() <= 1e-5
    assert (later - expected).abs().max().item() <= 1e-5


def tiny_pair() -> tuple[WanTransformer3DModel, torch.nn.Module]:
    torch.manual_seed(0)
    reference = WanTransformer3DModel(**TINY.to_diffusers_config()).eval()
    state = {name: (t, Path("<test>")) for name, t in reference.state_dict().items()}
    model = wan_dit_from_tensors(TINY, state, source=Path("<test>"), dtype=torch.float32, device="cpu")
    return reference, model


def test_fuse_projections_same_output_one_copy_of_the_weights():
    reference, model = tiny_pair()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 4, 3, 4, 6, generator=gen)
    text = torch.randn(2, TINY.text_len, TINY.text_dim, generator=gen)
    timestep = torch.tensor([700.0, 700.0])
    with torch.no_grad():
        plain = model(latents, timestep, text, attention=SDPAImpl())
        model.fuse_projections()
        fused = model(latents, timestep, text, attention=SDPAImpl())
        expected = reference(latents, timestep, text, return_dict=False)[0]
    after = model.state_dict()
    assert list(after) == list(before)  # checkpoint names only: the stacks are non-persistent buffers
    assert all(torch.equal(after[name], before[name]) for name in before)
    attn1, attn2 = model.blocks[0].attn1, model.blocks[0].attn2
    assert attn1.fused_weight.shape == (3 * TINY.dim, TINY.dim) and attn2.fused_weight.shape == (
        2 * TINY.dim,
        TINY.dim,
    )
    # the parameters are slices of the stack: one copy of the weights
    stack = attn1.fused_weight.untyped_storage().data_ptr()
    assert all(
        getattr(attn1, name).weight.untyped_storage().data_ptr() == stack for name in ("to_q", "to_k", "to_v")
    )
    assert attn2.to_q.weight.untyped_storage().data_ptr() != attn2.fused_weight.untyped_storage().data_ptr()
    # the stacked q/k/v GEMM vs three separate ones: other shapes, fp32 rounding only (a few ulps of O(1))
    assert (fused - plain).abs().max().item() <= 1e-5
    assert (fused - expected).abs().max().item() <= 1e-5
    # loading a state dict in place updates the stack through the shared storage
    changed = {name: t + 0.01 if name.endswith("attn1.to_k.weight") else t for name, t in before.items()}
    model.load_state_dict(changed)
    assert torch.equal(attn1.fused_weight[TINY.dim : 2 * TINY.dim], changed["blocks.0.attn1.to_k.weight"])
    # a dtype change re-stacks: still one copy, values converted
    model.double()
    assert attn1.fused_weight.dtype == torch.float64
    assert attn1.to_v.weight.untyped_storage().data_ptr() == attn1.fused_weight.untyped_storage().data_ptr()
    assert torch.equal(attn1.fused_weight[2 * TINY.dim :], attn1.to_v.weight)


def test_pipeline_compile_flag_compiles_once_and_is_recorded(default_model_dir, monkeypatch):
    from mmgen.errors import ValidationError
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    small = dict(height=32, width=48, num_frames=5, num_inference_steps=2, seed=3, progress=False)
    plain = pipe("a fox", **small)
    calls = []
    compile_blocks = pipe.transformer.compile_blocks

    def on_cpu(**options):  # inductor on CPU would need a C++ toolchain and minutes; the flow is the same
        calls.append(options)
        return compile_blocks(backend="aot_eager")

    monkeypatch.setattr(pipe.transformer, "compile_blocks", on_cpu)
    with pytest.raises(ValidationError, match="compile = 'yes'"):
        pipe("a fox", compile="yes", **small)
    try:
        first = pipe("a fox", compile=True, **small)
        second = pipe("a fox", compile=True, **small)
    finally:
        torch._dynamo.reset()
    assert len(calls) == 1 and pipe.transformer.blocks_compiled
    assert plain.args["compile"] is False and first.args["compile"] is True
    # The stacked q/k/v and the compiled graph are other shapes and op sequences: fp32 rounding, which
    # two guided steps of the trained model carry to ~2e-5 where a CPU's BLAS rounds the shapes apart
    # (as batched vs sequential CFG, test_denoise_loop); equal on the dev machine. Hence its 1e-4.
    assert (first.latents - plain.latents).abs().max().item() <= 1e-4
    assert first.latents_sha256 == second.latents_sha256


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_row_kernels_match_the_torch_references(dtype):
    from mmgen.layers.fused_norms import add_residual, layer_norm_modulate, residual_layer_norm, rms_norm_rope

    gen = torch.Generator(device="cuda").manual_seed(5)
    batch, seq, dim, heads = 2, 37, 192, 3  # odd row count: the last program's rows are masked
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the references round at more points

    def rand(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(kind)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    x, update = rand(batch, seq, dim), rand(batch, seq, dim)
    vectors = rand(batch, 6, dim, kind=torch.float32).chunk(6, dim=1)  # strided [B, 1, D], as in the block
    weight, bias = rand(dim, kind=torch.float32), rand(dim, kind=torch.float32)
    for kwargs in ({"shift": vectors[0], "scale": vectors[1]}, {"weight": weight, "bias": bias}):
        got = layer_norm_modulate(x, eps=1e-6, **kwargs)
        assert rel(got, layer_norm_modulate(x, eps=1e-6, kernel=False, **kwargs)) <= tol
        for gate in (vectors[2], None):
            got = residual_layer_norm(x, update, gate, eps=1e-6, **kwargs)
            want = residual_layer_norm(x, update, gate, eps=1e-6, kernel=False, **kwargs)
            assert got[0].dtype == got[1].dtype == dtype
            assert rel(got[0], want[0]) <= tol and rel(got[1], want[1]) <= tol
    for gate in (vectors[2], None):
        got = add_residual(x, update, gate)
        assert got.dtype == dtype and rel(got, add_residual(x, update, gate, kernel=False)) <= tol
    grid = (1, 37, 1)
    rope = rope_3d_tables(grid, dim // heads, device="cuda")
    wide = rand(batch, seq, 3 * dim)
    for part in (wide[..., dim : 2 * dim], x):  # a column slice of a stacked projection, and a plain tensor
        for table in (rope, None):
            got = rms_norm_rope(part, weight.to(dtype), 1e-6, heads=heads, rope=table)
            want = rms_norm_rope(part, weight.to(dtype), 1e-6, heads=heads, rope=table, kernel=False)
            assert got.shape == (batch, seq, heads, dim // heads) and got.is_contiguous()
            assert rel(got, want) <= tol
