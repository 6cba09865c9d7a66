"""Per-token modulation (Wan2.2 TI2V) as a table of distinct timesteps plus a per-token index.

CPU: the compact form gives today's per-token vectors (time projection of every token + the table),
the row functions' torch path reads it as the expanded [B, S, D] vectors would be read, and WanDiT
embeds only the distinct timesteps. Triton: the row kernels' per-token form against the torch path
in the Triton interpreter (a subprocess with TRITON_INTERPRET=1; skips without triton) and on CUDA
(skips without it; the lead runs those on the GPU: benchmarks/gpu_session.sh ti2v_cuda_tests).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from wan_cases import DIFFUSERS_TINY_DIT
from wan_cases import jittered_diffusers_dit as jittered

from mmgen.attention import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.layers.fused_norms import add_residual, layer_norm_modulate, residual_layer_norm
from mmgen.layers.modulation import distinct_timesteps, modulation_vectors, token_vectors
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanConfig, WanDiT

TI2V = {**DIFFUSERS_TINY_DIT, "in_channels": 6, "out_channels": 6}
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not HAS_TRITON, reason="needs CUDA and Triton"
)


def ti2v_timesteps(batch: int, grid: tuple[int, int, int], t: float) -> torch.Tensor:
    """[batch, S]: the first latent frame's tokens at 0, the rest at t (diffusers' expand_timesteps)."""
    mask = torch.ones(grid)
    mask[0] = 0
    return (mask.flatten() * t).expand(batch, -1)


def tables(n: int, dim: int, gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """Six float32 vector tables [n, 1, dim], row-strided views of one [n, 6, dim] (as the block makes them)."""
    table = torch.randn(1, 6, dim, generator=gen).to(device)
    projection = torch.randn(n, 6, dim, generator=gen).to(device)
    return modulation_vectors(table, projection, 6)


# ----------------------------------------------------------------------------------------------
# CPU: the compact form and the torch path


def test_distinct_timesteps_index_back_to_every_token():
    timestep = torch.stack([ti2v_timesteps(1, (3, 2, 2), 757.0)[0], ti2v_timesteps(1, (3, 2, 2), 12.5)[0]])
    values, rows = distinct_timesteps(timestep)
    assert values.tolist() == [0.0, 12.5, 757.0] and rows.dtype == torch.int32
    assert rows.shape == timestep.shape and torch.equal(values[rows.long()], timestep)


def test_vectors_from_distinct_timesteps_equal_the_per_token_projection():
    # Today's per-token path: every token's timestep through the time MLP, plus the block's table.
    model = WanDiT(WanConfig.from_diffusers_config(TI2V)).eval()
    embedder, table = model.condition_embedder, model.blocks[0].scale_shift_table
    timestep = ti2v_timesteps(2, (3, 2, 3), 321.5)
    with torch.no_grad():
        per_token = embedder.timestep_embedding(timestep, torch.float32)[1].unflatten(-1, (6, -1))
        expected = (table.float() + per_token.float()).unbind(2)  # six [B, S, D]
        values, rows = distinct_timesteps(timestep)
        projection = embedder.timestep_embedding(values, torch.float32)[1].unflatten(-1, (6, -1))
        got = modulation_vectors(table, projection, 6)
    assert projection.shape[0] == 2  # t = 0 and t = 321.5 only
    for vector, want in zip(got, expected, strict=True):
        assert vector.shape == (2, 1, want.shape[-1])
        torch.testing.assert_close(token_vectors(vector, rows), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_path_reads_the_table_as_the_expanded_vectors(dtype):
    gen = torch.Generator().manual_seed(2)
    batch, seq, dim = 2, 7, 48
    x, update = torch.randn(batch, seq, dim, generator=gen), torch.randn(batch, seq, dim, generator=gen)
    x, update = x.to(dtype), update.to(dtype)
    shift, scale, gate, *_ = tables(3, dim, gen)
    rows = torch.randint(0, 3, (batch, seq), generator=gen, dtype=torch.int32)
    expanded = {
        name: token_vectors(v, rows) for name, v in (("shift", shift), ("scale", scale), ("gate", gate))
    }
    assert expanded["shift"].shape == (batch, seq, dim)
    # the same float32 values rounded once: equal up to float32 contraction, then one bf16 step at most
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 8e-3}
    got = layer_norm_modulate(x, eps=1e-6, shift=shift, scale=scale, kernel=False, token_rows=rows)
    want = layer_norm_modulate(x, eps=1e-6, shift=expanded["shift"], scale=expanded["scale"], kernel=False)
    torch.testing.assert_close(got, want, **tol)
    got = residual_layer_norm(
        x, update, gate, eps=1e-6, shift=shift, scale=scale, kernel=False, token_rows=rows
    )
    want = residual_layer_norm(
        x, update, expanded["gate"], eps=1e-6, shift=expanded["shift"], scale=expanded["scale"], kernel=False
    )
    torch.testing.assert_close(got, want, **tol)
    got = add_residual(x, update, gate, kernel=False, token_rows=rows)
    torch.testing.assert_close(got, add_residual(x, update, expanded["gate"], kernel=False), **tol)


def test_token_rows_of_the_wrong_shape_or_dtype_raise():
    x = torch.zeros(2, 5, 8)
    shift = scale = torch.zeros(2, 1, 8)
    with pytest.raises(ValidationError, match=r"token_rows must be int32/int64 of shape \(2, 5\)"):
        layer_norm_modulate(
            x, eps=1e-6, shift=shift, scale=scale, token_rows=torch.zeros(2, 4, dtype=torch.int32)
        )
    with pytest.raises(ValidationError, match="token_rows must be int32/int64"):
        add_residual(x, x, shift, token_rows=torch.zeros(2, 5))


def test_dit_embeds_only_the_distinct_timesteps_and_matches_diffusers():
    reference = jittered(TI2V)
    model = WanDiT(WanConfig.from_diffusers_config(dict(reference.config))).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 6, 3, 4, 6, generator=gen)
    text = torch.randn(2, 512, 32, generator=gen)
    text[:, 7:] = 0
    timestep = ti2v_timesteps(2, (3, 2, 3), 640.0)
    seen: list[int] = []
    hook = model.condition_embedder.time_proj.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0])
    )
    with torch.no_grad():
        out = model(latents, timestep, text, attention=SDPAImpl())
        expected = reference(latents, timestep, text, return_dict=False)[0]
    hook.remove()
    assert seen == [2]  # two distinct timesteps embedded, not B * S = 36 tokens
    assert (out - expected).abs().max().item() <= 1e-5


# ----------------------------------------------------------------------------------------------
# Triton: the per-token kernels against the torch path


def _kernel_checks(device: str) -> list[str]:
    """Run every per-token row kernel on `device` tensors (CPU: the Triton interpreter) against the torch
    path; returns the failures (empty: all within tolerance). Calls the launcher directly: fused_norms
    only routes CUDA tensors to it."""
    from mmgen.layers import triton_norms

    failures: list[str] = []
    gen = torch.Generator().manual_seed(5)
    batch, seq, dim = 2, 7, 48  # odd rows and a non-power-of-two width: masked rows and columns

    def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        error = ((got.float() - want.float()).norm() / want.float().norm()).item()
        if not error <= tol:
            failures.append(f"{name}: relative error {error:.2e} > {tol:.0e}")

    for dtype in (torch.float32, torch.bfloat16):
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        x = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
        update = torch.randn(batch, seq, dim, generator=gen).to(device, dtype)
        shift, scale, gate, *_ = tables(3, dim, gen, device)
        weight, bias = torch.randn(dim, generator=gen).to(device), torch.randn(dim, generator=gen).to(device)
        rows = torch.randint(0, 3, (batch, seq), generator=gen, dtype=torch.int32).to(device)
        for affine in (False, True):
            w, b = (weight, bias) if affine else (None, None)
            tag = f"{dtype} affine={affine}"
            _, h = triton_norms.residual_layer_norm(x, None, None, w, b, shift, scale, 1e-6, token_rows=rows)
            want = layer_norm_modulate(
                x.cpu(), eps=1e-6, weight=_cpu(w), bias=_cpu(b), shift=shift.cpu(), scale=scale.cpu(),
                kernel=False, token_rows=rows.cpu(),
            )  # fmt: skip
            check(f"layer_norm_modulate {tag}", h.cpu(), want, tol)
            for g in (gate, None):
                got = triton_norms.residual_layer_norm(
                    x, update, g, w, b, shift, scale, 1e-6, token_rows=rows
                )
                want = residual_layer_norm(
                    x.cpu(), update.cpu(), _cpu(g), eps=1e-6, weight=_cpu(w), bias=_cpu(b), shift=shift.cpu(),
                    scale=scale.cpu(), kernel=False, token_rows=rows.cpu(),
                )  # fmt: skip
                check(f"residual_layer_norm {tag} gate={g is not None} x", got[0].cpu(), want[0], tol)
                check(f"residual_layer_norm {tag} gate={g is not None} h", got[1].cpu(), want[1], tol)
        got = triton_norms.residual_layer_norm(
            x, update, gate, None, None, None, None, 0.0, norm=False, token_rows=rows
        )[0]
        want = add_residual(x.cpu(), update.cpu(), gate.cpu(), kernel=False, token_rows=rows.cpu())
        check(f"add_residual {dtype}", got.cpu(), want, tol)
        # the per-sample form (row b for sample b) through the same kernel
        per_sample = tables(batch, dim, gen, device)
        got = triton_norms.residual_layer_norm(x, update, *per_sample[2:3], None, None, *per_sample[:2], 1e-6)
        want = residual_layer_norm(
            x.cpu(), update.cpu(), per_sample[2].cpu(), eps=1e-6, shift=per_sample[0].cpu(),
            scale=per_sample[1].cpu(), kernel=False,
        )  # fmt: skip
        check(f"residual_layer_norm {dtype} per sample", got[1].cpu(), want[1], tol)
        # int64 indices, and a range of a longer sequence's index (the block_chunk path slices it)
        wide = torch.randint(0, 3, (batch, seq + 3), generator=gen).to(device)[:, 2 : 2 + seq]
        got = triton_norms.residual_layer_norm(
            x, update, gate, None, None, shift, scale, 1e-6, token_rows=wide.contiguous()
        )
        want = residual_layer_norm(
            x.cpu(), update.cpu(), gate.cpu(), eps=1e-6, shift=shift.cpu(), scale=scale.cpu(), kernel=False,
            token_rows=wide.cpu(),
        )  # fmt: skip
        check(f"residual_layer_norm {dtype} int64 range", got[1].cpu(), want[1], tol)
        # e4m3 stores need compute capability >= 8.9 on a GPU; the interpreter emulates them
        fp8 = device == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
        if dtype == torch.bfloat16 and fp8:
            _fp8_checks(x, update, rows, (shift, scale, gate), per_sample, device, failures)
    return failures


def _fp8_checks(x, update, rows, vectors, per_sample, device: str, failures: list[str]) -> None:
    """The fp8-output kernel (residual + norm + modulation, quantized per row) in the per-token form:
    against the per-sample form given the same vectors per token (same kernel, same rounding: this part
    runs in the interpreter too, whose fp8 conversion rounds unlike a GPU's) and, on CUDA, against the
    torch path (which quantizes its bf16 rounding, the kernel its float32 value: one e4m3 step apart)."""
    from mmgen.layers import triton_norms
    from mmgen.layers.fp8_linear import quantize_rows_reference

    batch, seq, _ = x.shape

    def run(shift, scale, gate, token_rows):
        scales = torch.empty(batch, seq, 1, device=x.device)
        _, h = triton_norms.residual_layer_norm(
            x, update, gate, None, None, shift, scale, 1e-6, fp8_scales=scales, token_rows=token_rows
        )
        return h.float().cpu() * scales.cpu(), scales.cpu()

    def within_a_step(got, ref_values, ref_scales, name):
        step = ref_values.abs().clamp(min=2**-6) / 8 * ref_scales
        if not bool(((got - ref_values * ref_scales).abs() <= step * 1.1 + 1e-30).all()):
            failures.append(f"{name}: fp8 values more than one e4m3 step apart")

    own = torch.arange(batch, dtype=torch.int32, device=x.device)[:, None].expand(batch, seq).contiguous()
    got, got_scales = run(*per_sample[:3], own)
    want, want_scales = run(*per_sample[:3], None)
    if not torch.allclose(got_scales, want_scales, rtol=1e-6, atol=0):
        failures.append("fp8 row scales: per-token form != per-sample form")
    within_a_step(got, want / want_scales, want_scales, "fp8 per-token vs per-sample")
    if device == "cpu":
        return
    shift, scale, gate = vectors
    got, got_scales = run(shift, scale, gate, rows)
    _, h = residual_layer_norm(
        x.cpu(), update.cpu(), gate.cpu(), eps=1e-6, shift=shift.cpu(), scale=scale.cpu(), kernel=False,
        token_rows=rows.cpu(),
    )  # fmt: skip
    ref = quantize_rows_reference(h)
    if not torch.allclose(got_scales, ref.scales, rtol=1e-2, atol=0):
        failures.append("fp8 row scales: kernel vs torch path beyond bf16 rounding")
    within_a_step(got, ref.values.float(), ref.scales, "fp8 per-token vs torch path")


def _cpu(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.cpu()


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton (the interpreter runs the kernels on the CPU)")
def test_per_token_kernels_in_the_triton_interpreter():
    # The interpreter is chosen when triton.jit decorates a kernel: a fresh process with the switch set.
    tests = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path.insert(0, {str(tests)!r}); import test_token_modulation as t; "
        "failures = t._kernel_checks('cpu'); print('\\n'.join(failures) or 'ok'); sys.exit(bool(failures))"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


@needs_cuda
def test_per_token_kernels_on_cuda():
    assert _kernel_checks("cuda") == []


@needs_cuda
@pytest.mark.parametrize("chunk", [None, 7])
def test_ti2v_dit_runs_the_row_kernels_on_cuda(chunk):
    from unittest import mock

    from mmgen.layers import fused_norms

    reference = jittered(TI2V)
    model = WanDiT(WanConfig.from_diffusers_config(dict(reference.config))).eval()
    model.load_state_dict(reference.state_dict(), strict=True)
    model = model.cuda()
    settings = ExecutionSettings(block_chunk=chunk)
    gen = torch.Generator().manual_seed(4)
    latents = torch.randn(2, 6, 3, 4, 6, generator=gen).cuda()
    text = torch.randn(2, 512, 32, generator=gen).cuda()
    timestep = ti2v_timesteps(2, (3, 2, 3), 640.0).cuda()
    # the kernels' entry points (compile_guard.OpaqueOp calls its fn in eager code), counted
    kernels = {
        name: getattr(fused_norms, f"_{name}_cuda")
        for name in ("layer_norm_modulate", "residual_layer_norm", "add_residual")
    }
    with torch.no_grad():
        with contextlib.ExitStack() as stack:
            count = {
                name: stack.enter_context(mock.patch.object(op, "fn", wraps=op.fn))
                for name, op in kernels.items()
            }
            fused = model(latents, timestep, text, attention=SDPAImpl(), settings=settings)
        plain = model.set_fused_kernels(False)(
            latents, timestep, text, attention=SDPAImpl(), settings=settings
        )
    calls = len(model.blocks) * (1 if chunk is None else 3)  # 18 tokens in ranges of 7: 3 ranges
    # norm1, norm2 (residual), norm3 (residual) per block (per range)
    assert count["layer_norm_modulate"].call_count + count["residual_layer_norm"].call_count == 3 * calls
    assert count["add_residual"].call_count == calls
    torch.testing.assert_close(fused, plain, atol=1e-4, rtol=1e-4)
