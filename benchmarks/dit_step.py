"""One Wan denoising step (cond + uncond, batch 2) on one GPU: mmgen against diffusers, same weights.

Run from the repository root on a CUDA machine with diffusers (fa3-fwd and flash-attn-4 optional):

    python3 benchmarks/dit_step.py                     # Wan2.1-T2V-1.3B, 480x832x81 (32,760 tokens)
    python3 benchmarks/dit_step.py --model 14b         # Wan2.1-T2V-14B, 720x1280x81 (75,600 tokens)
    python3 benchmarks/dit_step.py --pipeline --steps 50   # the whole pipeline, mmgen vs diffusers
    python3 benchmarks/dit_step.py --tiny              # CPU smoke run of the harness (tiny config)
    python3 benchmarks/dit_step.py --ab                # round 1 vs round 2 of mmgen's fast paths (below)

Step mode. Random bf16 weights go into diffusers' WanTransformer3DModel (norms, modulation tables
and the time MLP kept fp32, as its from_pretrained does) and, tensor for tensor, into mmgen's
WanDiT. Rows: mmgen with each attention provider found (FA3 through fa3-fwd, FA4, cuDNN SDPA,
SDPA flash = FA2 inside torch; SDPA forced with torch.nn.attention.sdpa_kernel), eager and with
WanDiT.compile_blocks(); diffusers under its default attention, `_native_cudnn`, `_native_flash`,
its `_flash_3` backend pointed at fa3-fwd (the same FA3 kernel mmgen calls) and `_native_flash`
after torch's activate_flash_attention_impl("FA4") (the same FA4 kernel), plus diffusers' default
called as its WanPipeline does (two batch-1 calls). Attempts that cannot run say why.

Printed: ms per step (median of --iters after warm-up, CUDA events), spread, ratio to the floor and
to each diffusers variant, achieved TFLOP/s, output error against diffusers' default bf16 output
(max abs, relative L2) and against a diffusers fp32 forward of the conditional sample, the peak GPU
memory a row allocates above the weights, first-call seconds
(compilation included). The floor counts attention FLOPs (4 S^2 d per head and layer for
self-attention, 4 S L d for cross-attention) at the measured attention peak (the fastest FA kernel
at the Wan shape) plus linear FLOPs (2 x params x tokens) at the measured bf16 matmul peak
(8192^3). A kernel-time breakdown (torch.profiler) splits chosen rows into attention, GEMM, fused
(inductor) and other kernels, and the launch gaps (step time minus kernel time).

A/B mode (--ab): mmgen round 1 (torch row passes, three q/k/v GEMMs; eager and compiled as of
commit 204668a) against round 2 (Triton row kernels, stacked q/k/v; eager and compiled), diffusers
default / `_native_cudnn` / `_flash_3` for the ratios; NVML SM clock, power and power-cap state over
each row's timed calls; FA3 and an FFN GEMM run back to back (burst vs sustained rate); the row
passes alone against their byte floor at the measured copy bandwidth, with tile sweeps; the
strides of q/k/v as they reach the FA kernel. --ablation adds round 2 without stacked q/k/v and a
drift check.

Pipeline mode: UMT5-XXL-size text encoder (random weights, shared by both), the Wan2.1 VAE (random
weights, one instance for both), UniPC, --steps steps at full size; prints per-stage seconds for
mmgen, total for diffusers' WanPipeline, and the PSNR of mmgen's frames against diffusers'.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib.metadata
import json
import math
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mmgen.attention import FlashAttentionImpl, SDPAImpl  # noqa: E402
from mmgen.attention.impls import load_provider  # noqa: E402
from mmgen.loading.wan_transformer import wan_dit_from_tensors  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402

RANDOM = Path("<random weights>")
MODELS = {
    "1.3b": (WanConfig.wan21_t2v_1_3b(), (480, 832, 81)),
    "14b": (WanConfig.wan21_t2v_14b(), (720, 1280, 81)),
}
TINY = WanConfig(
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=32,
    ffn_dim=256,
    num_layers=2,
    text_len=32,
)
# The diffusers backend that runs the same kernel as each mmgen attention kernel.
SAME_KERNEL = {
    "fa3": "diffusers _flash_3 (fa3-fwd)",
    "fa4": "diffusers _native_flash+torch FA4",
    "cudnn": "diffusers _native_cudnn",
    "fa2": "diffusers _native_flash",
}
DEFAULT_ROW = "diffusers default"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny config and sizes (harness smoke run, CPU ok)"
    )
    parser.add_argument("--height", type=int, help="video height (default: the model's)")
    parser.add_argument("--width", type=int, help="video width")
    parser.add_argument("--frames", type=int, help="video frames (4k + 1)")
    parser.add_argument("--iters", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row (eager; compiled: +1)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled mmgen rows")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the blocks")
    parser.add_argument("--no-fp32", action="store_true", help="skip the diffusers fp32 reference forward")
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel-time breakdown")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    parser.add_argument("--pipeline", action="store_true", help="time the whole pipeline instead of one step")
    parser.add_argument(
        "--ab",
        action="store_true",
        help="A/B of mmgen's round-1 and round-2 fast paths (FA3) with clocks, layouts and row-kernel timings",
    )
    parser.add_argument(
        "--ablation",
        action="store_true",
        help="A/B mode: also round 2 without stacked q/k/v, and both compiled rows again at the end (drift)",
    )
    parser.add_argument("--steps", type=int, default=50, help="pipeline mode: denoising steps")
    parser.add_argument(
        "--attention", default="flash:fa3", help="pipeline mode: mmgen attention backend (BACKEND_NAMES)"
    )
    return parser.parse_args()


# ----------------------------------------------------------------------------------------------
# measurement helpers


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int,
    iters: int,
    during: contextlib.AbstractContextManager | None = None,
) -> tuple:
    """(last output, first-call seconds, [ms of each timed call]); CUDA events on a GPU; `during` wraps the timed calls."""
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        out = fn()
    times = []
    with during if during is not None else contextlib.nullcontext():
        out, times = _timed_calls(fn, device, iters, out)
    return out, first, times


def _timed_calls(fn: Callable[[], object], device: torch.device, iters: int, out: object) -> tuple:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            tick = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - tick) * 1e3)
    return out, times


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:150] if text else ''}"


def versions() -> dict[str, str]:
    found = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    if torch.backends.cudnn.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    for dist in ("diffusers", "transformers", "triton", "fa3-fwd", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


# ----------------------------------------------------------------------------------------------
# FLOPs and peaks


@dataclass(frozen=True)
class Work:
    """FLOPs of one DiT call: attention (self, cross) and linear layers."""

    self_attn: float
    cross_attn: float
    linear: float

    @property
    def attention(self) -> float:
        return self.self_attn + self.cross_attn

    @property
    def total(self) -> float:
        return self.attention + self.linear


def dit_flops(config: WanConfig, batch: int, tokens: int, text_len: int) -> Work:
    """Matmul FLOPs of one forward: 2 x weights x tokens for linears, 4 S Sk d per layer for attention."""
    d, ffn, layers = config.dim, config.ffn_dim, config.num_layers
    patch = math.prod(config.patch_size)
    video, text = batch * tokens, batch * text_len
    per_block = 2 * video * (4 * d * d + 2 * d * d + 2 * d * ffn) + 2 * text * (2 * d * d)
    embed = 2 * video * (config.in_channels * patch * d + d * config.out_channels * patch)
    embed += 2 * text * (config.text_dim * d + d * d)
    return Work(
        self_attn=layers * batch * 4 * tokens * tokens * d,
        cross_attn=layers * batch * 4 * tokens * text_len * d,
        linear=layers * per_block + embed,
    )


def matmul_peak(device: torch.device, size: int) -> float:
    """bf16 [size]^3 matmul TFLOP/s on random data (median of 10)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    _, _, times = timed(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * size**3 / (statistics.median(times) * 1e-3) / 1e12


def attention_kernels(device: torch.device) -> dict[str, Callable]:
    """Dense attention callables q, k, v [B, S, H, D] -> out, by kernel name, that run here."""
    found: dict[str, Callable] = {}
    if device.type != "cuda":
        return {"sdpa": lambda q, k, v: SDPAImpl()(q, k, v, _dense())}
    for name in ("fa3", "fa4"):
        provider = load_provider(name)
        if provider is not None:
            found[name] = lambda q, k, v, p=provider: p.dense(q, k, v, q.shape[-1] ** -0.5)
    found["cudnn"] = lambda q, k, v: _forced_sdpa(q, k, v, "cudnn")
    return found


def _dense():
    from mmgen.attention import AttentionMetadata

    return AttentionMetadata()


def _sdpa_backend(kind: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[kind]


def _forced_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str) -> torch.Tensor:
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backend(kind)):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def attention_peaks(device: torch.device, shape: tuple[int, int, int, int]) -> dict[str, float | str]:
    """Self-attention TFLOP/s at `shape` [B, S, H, D] per kernel (or why it failed)."""
    batch, seq, heads, head_dim = shape
    flops = 4 * batch * heads * seq * seq * head_dim
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    peaks: dict[str, float | str] = {}
    for name, fn in attention_kernels(device).items():
        try:
            _, _, times = timed(lambda fn=fn: fn(q, k, v), device, warmup=2, iters=5)
            peaks[name] = flops / (statistics.median(times) * 1e-3) / 1e12
        except Exception as err:  # report and go on: a kernel that fails here is skipped below too
            peaks[name] = one_line(err)
    return peaks


# ----------------------------------------------------------------------------------------------
# models and inputs


def build_models(config: WanConfig, device: torch.device) -> tuple[torch.nn.Module, WanDiT]:
    """diffusers WanTransformer3DModel (bf16, its fp32 modules fp32) and mmgen WanDiT with the same weights."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # build in bf16: a 14B model built in fp32 would need 57 GB
    try:
        with torch.device(device):
            reference = WanTransformer3DModel(**config.to_diffusers_config())
    finally:
        torch.set_default_dtype(previous)
    keep = WanTransformer3DModel._keep_in_fp32_modules  # what from_pretrained(torch_dtype=bf16) keeps fp32
    for name, param in reference.named_parameters():
        if any(part in keep for part in name.split(".")):
            param.data = param.data.float()
    reference.eval().requires_grad_(False)
    model = wan_dit_from_tensors(
        config,
        {name: (t, RANDOM) for name, t in reference.state_dict().items()},
        source=RANDOM,
        dtype=torch.bfloat16,
        device=device,
    )
    return reference, model


@dataclass(frozen=True)
class Inputs:
    """One CFG step's DiT inputs: latents bf16 [2, C, F', H', W'], timestep [2], text bf16 [2, L, text_dim]."""

    latents: torch.Tensor
    timestep: torch.Tensor
    text: torch.Tensor

    @property
    def tokens(self) -> int:
        return self.latents.shape[2] * self.latents.shape[3] * self.latents.shape[4] // 4


def make_inputs(config: WanConfig, video: tuple[int, int, int], device: torch.device) -> Inputs:
    """The same noise for cond and uncond (as the pipeline batches them), two prompts zero-padded to text_len."""
    height, width, frames = video
    gen = torch.Generator().manual_seed(1)
    shape = (1, config.in_channels, (frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, generator=gen).expand(2, -1, -1, -1, -1)
    text = torch.randn(2, config.text_len, config.text_dim, generator=gen)
    text[0, config.text_len // 8 :] = 0  # the prompt: 1/8 of the tokens valid, the rest zero padding
    text[1, config.text_len // 32 :] = 0  # the negative prompt: shorter
    return Inputs(
        latents=latents.to(device, torch.bfloat16),
        timestep=torch.full((2,), 500.0, device=device),
        text=text.to(device, torch.bfloat16),
    )


# ----------------------------------------------------------------------------------------------
# rows


@dataclass
class Row:
    """One timed variant."""

    label: str
    family: str  # "mmgen" or "diffusers"
    kernel: str  # attention kernel: fa3, fa4, cudnn, fa2, torch-default, reference
    compiled: bool = False
    ms: float | None = None
    times: list[float] = field(default_factory=list)
    first_s: float | None = None
    peak_gib: float | None = None  # peak allocated during the row above what was allocated before it
    max_abs: float | None = None
    rel_err: float | None = None
    rel_fp32: float | None = None
    error: str | None = None
    gpu: dict = field(default_factory=dict)  # clocks and power over the timed calls (A/B mode)

    @property
    def spread(self) -> float | None:
        return (max(self.times) - min(self.times)) / self.ms if self.times and self.ms else None


def run_row(
    row: Row,
    fn: Callable[[], torch.Tensor],
    device: torch.device,
    args: argparse.Namespace,
    expected: torch.Tensor | None,
    truth: torch.Tensor | None,
    sampler: GpuSampler | None = None,
) -> torch.Tensor | None:
    """Time fn into row (errors are recorded, not raised); returns its output."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    warmup = args.warmup + (1 if row.compiled else 0)
    try:
        with torch.no_grad():
            out, row.first_s, row.times = timed(fn, device, warmup=warmup, iters=args.iters, during=sampler)
    except Exception as err:  # one failing variant must not end the run
        row.error = one_line(err)
        print(f"  {row.label}: FAILED {row.error}", flush=True)
        return None
    row.ms = statistics.median(row.times)
    if sampler is not None:
        row.gpu = sampler.summary()
    if device.type == "cuda":
        row.peak_gib = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if expected is not None:
        row.max_abs, row.rel_err = max_abs(out, expected), relative_error(out, expected)
    if truth is not None:
        row.rel_fp32 = relative_error(out[: truth.shape[0]], truth)
    print(f"  {row.label}: {row.ms:.1f} ms (first {row.first_s:.1f} s)", flush=True)
    return out


@contextlib.contextmanager
def sdpa_forced(kind: str | None) -> Iterator[None]:
    """torch SDPA restricted to one backend ("cudnn", "fa2"), or unchanged for None."""
    if kind is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_sdpa_backend(kind)):
        yield


@contextlib.contextmanager
def torch_flash_impl(name: str) -> Iterator[None]:
    """torch SDPA's flash backend replaced by FA3/FA4 (torch.nn.attention.activate_flash_attention_impl)."""
    from torch.nn import attention as torch_attention
    from torch.nn.attention import _registry

    torch_attention.activate_flash_attention_impl(name)
    try:
        yield
    finally:
        _registry.restore_flash_attention_impl()


def point_diffusers_flash3_at_fa3_fwd() -> str | None:
    """Make diffusers' `_flash_3` backend call fa3-fwd's FA3 (it imports `flash_attn_interface`); None or why not."""
    provider = load_provider("fa3")
    if provider is None:
        return "fa3-fwd not installed"
    from diffusers.models import attention_dispatch

    if not getattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", False):
        # Same signature (the FA3 beta interface); fa3-fwd just ships it under another module name.
        attention_dispatch.flash_attn_3_func = provider.flash_attn_func
        attention_dispatch._CAN_USE_FLASH_ATTN_3 = True
    return None


def diffusers_rows(
    reference: torch.nn.Module,
    inputs: Inputs,
    device: torch.device,
    args: argparse.Namespace,
    truth: torch.Tensor | None,
) -> tuple[list[Row], torch.Tensor | None]:
    """Diffusers' default attention, batched and as WanPipeline calls it; rows and the output (the reference)."""
    rows: list[Row] = []

    def forward(latents=inputs.latents, timestep=inputs.timestep, text=inputs.text) -> torch.Tensor:
        return reference(latents, timestep, text, return_dict=False)[0]

    reference.reset_attention_backend()
    row = Row(DEFAULT_ROW, "diffusers", "torch-default")
    expected = run_row(row, forward, device, args, None, truth)
    rows.append(row)
    if expected is not None:
        row.max_abs, row.rel_err = 0.0, 0.0

    def as_pipeline() -> torch.Tensor:  # WanPipeline calls the transformer once for cond, once for uncond
        halves = [
            forward(inputs.latents[i : i + 1], inputs.timestep[i : i + 1], inputs.text[i : i + 1])
            for i in (0, 1)
        ]
        return torch.cat(halves)

    rows.append(Row("diffusers default, 2x batch 1", "diffusers", "torch-default"))
    run_row(rows[-1], as_pipeline, device, args, expected, truth)
    return rows, expected


def diffusers_backend_rows(
    reference: torch.nn.Module,
    inputs: Inputs,
    device: torch.device,
    args: argparse.Namespace,
    expected: torch.Tensor | None,
    truth: torch.Tensor | None,
    *,
    fa2: bool = True,
    sampler: GpuSampler | None = None,
) -> list[Row]:
    """Diffusers with its attention backend set to cuDNN, FA2 (torch; unless fa2=False) and FA3 (fa3-fwd)."""
    rows: list[Row] = []

    def forward() -> torch.Tensor:
        return reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False)[0]

    backends = [("diffusers _native_cudnn", "_native_cudnn", "cudnn")]
    if fa2:
        backends.append(("diffusers _native_flash", "_native_flash", "fa2"))
    for label, backend, kernel in backends:
        rows.append(Row(label, "diffusers", kernel))
        reference.set_attention_backend(backend)
        run_row(rows[-1], forward, device, args, expected, truth, sampler)

    rows.append(Row(SAME_KERNEL["fa3"], "diffusers", "fa3"))
    why = point_diffusers_flash3_at_fa3_fwd()
    if why is None:
        try:
            reference.set_attention_backend("_flash_3")
            run_row(rows[-1], forward, device, args, expected, truth, sampler)
        except Exception as err:
            rows[-1].error = one_line(err)
    else:
        rows[-1].error = why
    reference.reset_attention_backend()
    return rows


def torch_flash_rows(
    reference: torch.nn.Module,
    inputs: Inputs,
    device: torch.device,
    args: argparse.Namespace,
    expected: torch.Tensor | None,
    truth: torch.Tensor | None,
) -> list[Row]:
    """diffusers `_native_flash` with torch's flash backend swapped for FA4 / FA3 (run last: it is process-wide)."""
    rows = []
    for name, kernel in (("FA4", "fa4"), ("FA3", "fa3")):
        label = f"diffusers _native_flash+torch {name}"
        rows.append(Row(label, "diffusers", kernel))
        reference.set_attention_backend("_native_flash")
        try:
            with torch_flash_impl(name):
                run_row(
                    rows[-1],
                    lambda: reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False)[0],
                    device,
                    args,
                    expected,
                    truth,
                )
        except (
            Exception
        ) as err:  # e.g. torch's FA3 wants torch.ops.flash_attn_3, which fa3-fwd does not register
            rows[-1].error = one_line(err)
            print(f"  {label}: FAILED {rows[-1].error}", flush=True)
    reference.reset_attention_backend()
    return rows


def mmgen_variants(device: torch.device) -> list[tuple[str, str, object, str | None]]:
    """(label suffix, kernel, impl, forced SDPA backend) for every attention path that runs here."""
    if device.type != "cuda":
        return [
            ("sdpa", "torch-default", SDPAImpl(), None),
            ("flash:reference", "reference", FlashAttentionImpl("reference"), None),
        ]
    variants = []
    for name in ("fa3", "fa4"):
        if load_provider(name) is not None:
            variants.append((f"flash:{name}", name, FlashAttentionImpl(name), None))
    variants.append(("sdpa:cudnn", "cudnn", SDPAImpl(), "cudnn"))
    variants.append(("sdpa:flash", "fa2", SDPAImpl(), "fa2"))
    return variants


def mmgen_rows(
    model: WanDiT,
    inputs: Inputs,
    device: torch.device,
    args: argparse.Namespace,
    expected: torch.Tensor | None,
    truth: torch.Tensor | None,
    *,
    compiled: bool,
) -> list[Row]:
    rows = []
    for suffix, kernel, impl, forced in mmgen_variants(device):
        mode = "compiled" if compiled else "eager"
        rows.append(Row(f"mmgen {suffix} {mode}", "mmgen", kernel, compiled=compiled))

        def step(impl=impl, forced=forced) -> torch.Tensor:
            with sdpa_forced(forced):
                return model(inputs.latents, inputs.timestep, inputs.text, attention=impl)

        run_row(rows[-1], step, device, args, expected, truth)
    return rows


def ffn_epilogue_rows(
    model: WanDiT, inputs: Inputs, device: torch.device, args: argparse.Namespace, expected, truth
) -> list[Row]:
    """The first FA row again, eager, with the FFN's GELU as a separate kernel (A/B of the fused epilogue)."""
    suffix, kernel, impl, forced = mmgen_variants(device)[0]
    projections = [block.ffn.net[0] for block in model.blocks]
    row = Row(f"mmgen {suffix} eager, unfused GELU", "mmgen", kernel)
    for projection in projections:
        projection.fuse_epilogue = False
    try:
        with sdpa_forced(forced):
            run_row(
                row,
                lambda: model(inputs.latents, inputs.timestep, inputs.text, attention=impl),
                device,
                args,
                expected,
                truth,
            )
    finally:
        for projection in projections:
            projection.fuse_epilogue = True
    return [row]


# ----------------------------------------------------------------------------------------------
# GELU epilogue check and kernel breakdown


def gelu_epilogue_check(config: WanConfig, tokens: int, device: torch.device) -> dict[str, float]:
    """fp32: torch._addmm_activation's GELU against tanh and erf GELU; bf16: ms fused vs addmm + gelu."""
    gen = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(2048, config.dim, device=device, generator=gen)
    w = torch.randn(config.ffn_dim, config.dim, device=device, generator=gen) / config.dim**0.5
    b = torch.randn(config.ffn_dim, device=device, generator=gen)
    fused = torch._addmm_activation(b, x, w.t(), use_gelu=True).double()
    plain = torch.addmm(b.double(), x.double(), w.double().t())
    found = {
        "fp32 fused vs tanh GELU (max abs)": max_abs(fused, F.gelu(plain, approximate="tanh")),
        "fp32 fused vs erf GELU (max abs)": max_abs(fused, F.gelu(plain)),
    }
    if device.type == "cuda":
        xs = torch.randn(2 * tokens, config.dim, device=device, dtype=torch.bfloat16, generator=gen)
        w16, b16 = w.bfloat16(), b.bfloat16()
        _, _, unfused = timed(
            lambda: F.gelu(torch.addmm(b16, xs, w16.t()), approximate="tanh"), device, warmup=2, iters=10
        )
        _, _, epilogue = timed(
            lambda: torch._addmm_activation(b16, xs, w16.t(), use_gelu=True), device, warmup=2, iters=10
        )
        found["bf16 FFN-up addmm + gelu ms"] = statistics.median(unfused)
        found["bf16 FFN-up fused epilogue ms"] = statistics.median(epilogue)
    return found


# mmgen's own Triton row kernels (mmgen.layers.triton_norms)
ROW_KERNELS = ("_residual_layer_norm_kernel", "_rms_norm_rope_kernel")


def kernel_category(name: str) -> str:
    low = name.lower()
    if any(s in low for s in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(s in name for s in ROW_KERNELS):
        return "mmgen triton"
    if low.startswith("triton"):
        return "fused (inductor)"
    if any(s in low for s in ("gemm", "xmma", "nvjet", "cutlass", "cublas", "matmul", "splitk")):
        return "gemm"
    return "other eager"


def kernel_breakdown(fn: Callable[[], object], device: torch.device) -> dict:
    """Kernel time per category (ms) over one call, kernel count and the top kernels, from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    per_category: dict[str, float] = {}
    per_kernel: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        ms = event.time_range.elapsed_us() / 1e3
        per_category[kernel_category(event.name)] = per_category.get(kernel_category(event.name), 0.0) + ms
        per_kernel.setdefault(event.name, []).append(ms)
    top = sorted(per_kernel.items(), key=lambda item: -sum(item[1]))[:10]
    return {
        "categories": per_category,
        "kernels": sum(len(v) for v in per_kernel.values()),
        "top": [(name[:90], sum(times), len(times)) for name, times in top],
    }


# ----------------------------------------------------------------------------------------------
# report


def print_step_report(
    header: str,
    rows: list[Row],
    work: Work,
    floor: dict[str, float],
    breakdowns: dict[str, dict],
) -> None:
    by_label = {row.label: row for row in rows}
    default = by_label.get(DEFAULT_ROW)
    cudnn = by_label.get(SAME_KERNEL["cudnn"])
    print("\n" + header)
    print(
        f"FLOPs per step: self-attn {work.self_attn / 1e12:.1f} T, cross-attn {work.cross_attn / 1e12:.2f} T, "
        f"linear {work.linear / 1e12:.1f} T; floor {floor['ms']:.0f} ms = attention {floor['attention_ms']:.0f} "
        f"ms at {floor['attention_tflops']:.0f} TF/s ({floor['attention_kernel']}) + linear "
        f"{floor['linear_ms']:.0f} ms at {floor['matmul_tflops']:.0f} TF/s"
    )
    head = (
        f"{'variant':<40} {'ms':>8} {'sprd':>5} {'xfloor':>6} {'vs def':>6} {'vs cdn':>6} {'vs same':>7} "
        f"{'TF/s':>5} {'max abs':>8} {'rel err':>8} {'rel f32':>8} {'+GiB':>5} {'1st s':>6}"
    )
    print(head)
    for row in rows:
        if row.ms is None:
            print(f"{row.label:<40} {row.error or 'not run'}")
            continue
        same = by_label.get(SAME_KERNEL.get(row.kernel, ""))

        def ratio(base: Row | None, row: Row = row) -> str:
            return f"{base.ms / row.ms:6.2f}" if base is not None and base.ms else f"{'-':>6}"

        def num(value: float | None, fmt: str, width: int) -> str:
            return f"{value:{width}{fmt}}" if value is not None else f"{'-':>{width}}"

        print(
            f"{row.label:<40} {row.ms:8.1f} {num(row.spread and 100 * row.spread, '.1f', 4)}% "
            f"{row.ms / floor['ms']:6.2f} {ratio(default)} {ratio(cudnn)} "
            f"{ratio(same) if row.family == 'mmgen' else '-':>7} {work.total / row.ms / 1e9:5.0f} "
            f"{num(row.max_abs, '.2e', 8)} {num(row.rel_err, '.2e', 8)} {num(row.rel_fp32, '.2e', 8)} "
            f"{num(row.peak_gib, '.1f', 5)} {num(row.first_s, '.1f', 6)}"
        )
    print(
        "(vs def / vs cdn / vs same: diffusers default / _native_cudnn / same-kernel ms over this row's ms; "
        "max abs, rel err: vs diffusers default bf16; rel f32: cond sample vs diffusers fp32; +GiB: peak "
        "memory above the weights and inputs already allocated)"
    )
    if not breakdowns:
        return
    print("\nKernel time per step (ms), torch.profiler; gaps = median step time - kernel time")
    categories = ("attention", "gemm", "fused (inductor)", "mmgen triton", "other eager")
    print(f"{'variant':<40} " + " ".join(f"{c:>16}" for c in categories) + f" {'gaps':>8} {'kernels':>8}")
    print(
        f"{'floor':<40} {floor['attention_ms']:16.1f} {floor['linear_ms']:16.1f}"
        + f" {0.0:16.1f}" * (len(categories) - 2)
        + f" {0.0:8.1f}"
    )
    for label, result in breakdowns.items():
        cats = result["categories"]
        kernel_ms = sum(cats.values())
        gaps = by_label[label].ms - kernel_ms if by_label[label].ms else float("nan")
        print(
            f"{label:<40} "
            + " ".join(f"{cats.get(c, 0.0):16.1f}" for c in categories)
            + f" {gaps:8.1f} {result['kernels']:8d}"
        )
    for label, result in breakdowns.items():
        print(f"top kernels, {label}:")
        for name, ms, count in result["top"]:
            print(f"  {ms:8.1f} ms {count:5d}x  {name}")


# ----------------------------------------------------------------------------------------------
# modes


def step_mode(args: argparse.Namespace, device: torch.device) -> dict:
    config, video = (TINY, (64, 96, 9)) if args.tiny else MODELS[args.model]
    video = (args.height or video[0], args.width or video[1], args.frames or video[2])
    reference, model = build_models(config, device)
    inputs = make_inputs(config, video, device)
    tokens = inputs.tokens
    work = dit_flops(config, 2, tokens, config.text_len)
    print(
        f"Wan {config.dim}d x {config.num_layers} layers, video {video[0]}x{video[1]}x{video[2]} -> "
        f"latents {tuple(inputs.latents.shape)} = {tokens} tokens, text {config.text_len}, batch 2 (CFG)",
        flush=True,
    )

    truth = None
    if not args.no_fp32 and args.model == "1.3b":
        with torch.no_grad():
            tf32 = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False  # the patch-embedding conv would run in TF32
            wide = copy.deepcopy(reference).float()
            # the conditional sample only: its row is what rel_fp32 compares (an fp32 step takes seconds)
            truth = wide(
                inputs.latents[:1].float(), inputs.timestep[:1], inputs.text[:1].float(), return_dict=False
            )[0]
            del wide
            torch.backends.cudnn.allow_tf32 = tf32
        print("  diffusers fp32 reference done", flush=True)

    peak_size = 8192 if device.type == "cuda" else 256
    matmul = matmul_peak(device, peak_size) if device.type == "cuda" else float("nan")
    peaks = attention_peaks(device, (2, tokens, config.num_attention_heads, config.attention_head_dim))
    numeric = {k: v for k, v in peaks.items() if isinstance(v, float)}
    best_kernel = max(numeric, key=numeric.get) if numeric else "none"
    attention_tflops = numeric.get(best_kernel, float("nan"))
    floor = {
        "attention_kernel": best_kernel,
        "attention_tflops": attention_tflops,
        "matmul_tflops": matmul,
        "attention_ms": work.attention / attention_tflops / 1e9,
        "linear_ms": work.linear / matmul / 1e9,
    }
    floor["ms"] = floor["attention_ms"] + floor["linear_ms"]
    print(f"  peaks: matmul {peak_size}^3 bf16 {matmul:.0f} TF/s; attention {peaks}", flush=True)
    gelu = gelu_epilogue_check(config, tokens, device)
    print(f"  GELU epilogue: {gelu}", flush=True)

    rows: list[Row] = []
    breakdowns: dict[str, dict] = {}
    profile_here = not args.no_profile and device.type == "cuda"
    first = mmgen_variants(device)[0]
    try:  # most wanted rows first; an interrupt (SIGTERM from a time limit) still prints what was measured
        default_rows, expected = diffusers_rows(reference, inputs, device, args, truth)
        rows += default_rows
        rows += mmgen_rows(model, inputs, device, args, expected, truth, compiled=False)
        rows += ffn_epilogue_rows(model, inputs, device, args, expected, truth)
        if profile_here:
            breakdowns[DEFAULT_ROW] = kernel_breakdown(
                lambda: reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False), device
            )
            breakdowns[f"mmgen {first[0]} eager"] = kernel_breakdown(
                _mmgen_step(model, inputs, first), device
            )
        if not args.no_compile:
            model.compile_blocks(backend=args.compile_backend)
            rows += mmgen_rows(model, inputs, device, args, expected, truth, compiled=True)
            if profile_here:
                breakdowns[f"mmgen {first[0]} compiled"] = kernel_breakdown(
                    _mmgen_step(model, inputs, first), device
                )
        if device.type == "cuda":
            rows += diffusers_backend_rows(reference, inputs, device, args, expected, truth)
            rows += torch_flash_rows(reference, inputs, device, args, expected, truth)
    except KeyboardInterrupt:
        print("INTERRUPTED: the tables below hold the rows measured so far", flush=True)

    env = versions()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = f"device {name} | " + " | ".join(f"{k} {v}" for k, v in env.items())
    print_step_report(header, rows, work, floor, breakdowns)
    return {
        "device": name,
        "versions": env,
        "video": video,
        "tokens": tokens,
        "work": asdict(work),
        "floor": floor,
        "attention_peaks": peaks,
        "gelu_epilogue": gelu,
        "rows": [asdict(row) for row in rows],
        "breakdowns": breakdowns,
    }


def _mmgen_step(model: WanDiT, inputs: Inputs, variant: tuple) -> Callable[[], torch.Tensor]:
    _, _, impl, forced = variant

    def step() -> torch.Tensor:
        with sdpa_forced(forced):
            return model(inputs.latents, inputs.timestep, inputs.text, attention=impl)

    return step


def psnr(a, b) -> float:
    """PSNR in dB of uint8 frames a against b."""
    import numpy as np

    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def pipeline_mode(args: argparse.Namespace, device: torch.device) -> dict:
    """Whole pipeline (text encode, denoise, VAE decode) for mmgen and diffusers' WanPipeline, same components."""
    import numpy as np
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import AutoTokenizer, UMT5EncoderModel
    from transformers import UMT5Config as HFUMT5Config

    from mmgen.default_model import VAE, WORDS
    from mmgen.loading.diffusers_dir import GenerationDefaults
    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.loading.tokenizer import TextTokenizer, build_word_tokenizer
    from mmgen.models.umt5 import UMT5Config, UMT5Encoder
    from pipelines.wan_t2v import WanT2VPipeline

    if args.tiny:
        config, video = TINY, (64, 96, 9)
        text_config = UMT5Config(
            vocab_size=512, d_model=TINY.text_dim, d_kv=8, d_ff=64, num_layers=2, num_heads=4
        )
        vae_config = {
            **copy.deepcopy(VAE),
            "z_dim": 16,
            "latents_mean": [0.0] * 16,
            "latents_std": [1.0] * 16,
        }
    else:
        config, video = MODELS[args.model]
        # UMT5-XXL, the text encoder of every Wan2.1 model
        text_config = UMT5Config(
            vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64
        )
        vae_config = {}  # diffusers' defaults are the Wan2.1 VAE
    video = (args.height or video[0], args.width or video[1], args.frames or video[2])
    reference, model = build_models(config, device)
    workdir = Path(tempfile.mkdtemp(prefix="mmgen-bench-"))
    build_word_tokenizer(list(WORDS), workdir / "tokenizer", model_max_length=config.text_len)

    torch.manual_seed(3)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            hf_encoder = UMT5EncoderModel(HFUMT5Config(**text_config.to_hf_config())).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.device("meta"):
        encoder = UMT5Encoder(text_config)
    tensors = {
        k: (v, RANDOM) for k, v in hf_encoder.state_dict().items() if k != "encoder.embed_tokens.weight"
    }
    load_into_module(encoder, tensors, source=RANDOM, dtype=torch.bfloat16, device=device)
    encoder.eval()
    with torch.device(device):
        vae = AutoencoderKLWan(**vae_config).eval()
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    height, width, frames = video
    defaults = GenerationDefaults(
        height=height, width=width, num_frames=frames, num_inference_steps=args.steps
    )
    ours = WanT2VPipeline(
        model, encoder, TextTokenizer.from_dir(workdir / "tokenizer"), vae, scheduler, defaults=defaults
    )
    theirs = WanPipeline(
        tokenizer=AutoTokenizer.from_pretrained(workdir / "tokenizer"),
        text_encoder=hf_encoder,
        vae=vae,
        scheduler=copy.deepcopy(scheduler),
        transformer=reference,
    )
    theirs.set_progress_bar_config(disable=True)
    prompt, negative = "a red fox running through a snowy forest at sunset", "blurry dark"
    noise = torch.randn(ours.latents_shape(height, width, frames), generator=torch.Generator().manual_seed(7))
    attention = args.attention if device.type == "cuda" else "sdpa"
    compile_blocks = not args.no_compile
    if compile_blocks:
        if args.compile_backend != "inductor":  # the pipeline's compile=True uses the default backend
            model.compile_blocks(backend=args.compile_backend)
        # one untimed short call compiles the blocks (the pipeline's compile flag) outside the timed run
        ours(
            prompt,
            negative,
            latents=noise,
            num_inference_steps=1,
            attention_backend=attention,
            progress=False,
            compile=True,
        )
    common = dict(
        height=height, width=width, num_frames=frames, num_inference_steps=args.steps, guidance_scale=5.0
    )

    synchronize(device)
    tick = time.perf_counter()
    result = ours(
        prompt,
        negative,
        latents=noise,
        attention_backend=attention,
        progress=False,
        compile=compile_blocks,
        **common,
    )
    ours_s = time.perf_counter() - tick
    with torch.no_grad():
        synchronize(device)
        tick = time.perf_counter()
        frames_theirs = theirs(
            prompt, negative, latents=noise.clone().to(device), output_type="np", **common
        ).frames[0]
        synchronize(device)
        theirs_s = time.perf_counter() - tick
    frames_theirs = np.round(np.clip(frames_theirs, 0, 1) * 255).astype(np.uint8)
    quality = psnr(result.frames, frames_theirs)
    env = versions()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ndevice {name} | " + " | ".join(f"{k} {v}" for k, v in env.items()))
    print(
        f"pipeline {height}x{width}x{frames}, {args.steps} steps, CFG 5.0, mmgen attention {attention}, "
        f"compiled {result.args['compile']} (the pipeline's compile flag)"
    )
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in result.timings.items())
    print(
        f"mmgen     total {ours_s:7.2f} s ({stages}; {result.timings['denoise'] / args.steps * 1e3:.0f} ms/step)"
    )
    print(f"diffusers total {theirs_s:7.2f} s (WanPipeline, default attention, cond/uncond as two calls)")
    print(
        f"speedup {theirs_s / ours_s:.2f}x; frames {result.frames.shape}; PSNR mmgen vs diffusers {quality:.2f} dB"
    )
    return {
        "device": name,
        "versions": env,
        "video": video,
        "steps": args.steps,
        "mmgen_s": ours_s,
        "mmgen_timings": result.timings,
        "diffusers_s": theirs_s,
        "psnr_db": quality,
    }


# ----------------------------------------------------------------------------------------------
# A/B mode: the round-1 paths against the round-2 paths, with clocks, layouts and row kernels

# NVML clock-event reason bits (nvml.h): software power cap; hardware slowdown, software and
# hardware thermal slowdown, hardware power brake.
POWER_CAP = 0x4
THERMAL_OR_HW = 0x8 | 0x20 | 0x40 | 0x80


class GpuSampler:
    """SM clock (MHz), board power (W) and clock-event reasons sampled through NVML every `period` s while entered."""

    def __init__(self, period: float = 0.005) -> None:
        self.period = period
        self.samples: list[tuple[int, float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception as err:  # no NVML: the rows simply carry no clock readings
            print(f"  NVML unavailable ({one_line(err)}); no clock readings", flush=True)
            self._nvml = None

    def __enter__(self) -> GpuSampler:
        self.samples = []
        if self._nvml is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        reasons = reasons or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            try:
                self.samples.append(
                    (
                        nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
                        nvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
                        int(reasons(handle)),
                    )
                )
            except Exception:
                return
            time.sleep(self.period)

    def summary(self) -> dict[str, float]:
        """Mean/min SM MHz, mean W, fraction of samples power-capped and thermally/hardware slowed."""
        if not self.samples:
            return {}
        clocks = [s[0] for s in self.samples]
        return {
            "sm_mhz": statistics.mean(clocks),
            "sm_mhz_min": min(clocks),
            "power_w": statistics.mean(s[1] for s in self.samples),
            "power_capped": sum(1 for s in self.samples if s[2] & POWER_CAP) / len(self.samples),
            "slowdown": sum(1 for s in self.samples if s[2] & THERMAL_OR_HW) / len(self.samples),
            "samples": len(self.samples),
        }


class LayoutRecorder:
    """Records what reaches the FA kernel in a step's first calls (shape, strides, alignment) while entered.

    It swaps the impl's kernel provider for one whose flash_attn_func records, on the same impl
    object: compiled blocks guard on the impl's type only, so this causes no recompilation.
    """

    def __init__(self, impl: object, keep: int = 2) -> None:
        self.impl, self.keep, self.seen = impl, keep, []
        self.original = getattr(impl, "kernel", None)

    def __enter__(self) -> LayoutRecorder:
        if self.original is not None:
            self.impl.kernel = dataclasses.replace(self.original, flash_attn_func=self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.original is not None:
            self.impl.kernel = self.original

    def _record(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> object:
        if len(self.seen) < self.keep:
            self.seen.append(
                {
                    name: f"{tuple(t.shape)} stride {tuple(t.stride())} contig {t.is_contiguous()} "
                    f"ptr%256 {t.data_ptr() % 256}"
                    for name, t in (("q", q), ("k", k), ("v", v))
                }
            )
        return self.original.flash_attn_func(q, k, v, **kwargs)


def sustained_rate(fn: Callable[[], object], device: torch.device, calls: int, flops: float) -> dict:
    """TFLOP/s of the first 5 calls (a burst, as the floor's peaks are taken) and of the last 20 of `calls` back-to-back."""
    sampler = GpuSampler()
    for _ in range(2):
        fn()
    synchronize(device)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)
    ]
    with sampler:
        for begin, end in events:
            begin.record()
            fn()
            end.record()
        synchronize(device)
    times = [begin.elapsed_time(end) for begin, end in events]
    burst, steady = statistics.median(times[:5]), statistics.median(times[-20:])
    return {
        "burst_tflops": flops / (burst * 1e-3) / 1e12,
        "sustained_tflops": flops / (steady * 1e-3) / 1e12,
        "seconds": sum(times) / 1e3,
        **sampler.summary(),
    }


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy GB/s (bytes read + written) over a 1 GiB buffer, median of 10."""
    src = torch.randn(2**28, device=device)
    dst = torch.empty_like(src)
    _, _, times = timed(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * src.numel() * 4 / (statistics.median(times) * 1e-3) / 1e9


def row_kernel_bench(config: WanConfig, inputs: Inputs, device: torch.device) -> dict:
    """The block's row passes at the step's size: Triton kernel vs torch reference ms, GB/s, error; tile sweeps."""
    from mmgen.layers import triton_norms
    from mmgen.layers.fused_norms import add_residual, layer_norm_modulate, residual_layer_norm, rms_norm_rope
    from mmgen.layers.rotary import rope_3d_tables

    batch, dim, heads, eps = 2, config.dim, config.num_attention_heads, config.eps
    grid = tuple(s // p for s, p in zip(inputs.latents.shape[2:], config.patch_size, strict=True))
    seq = math.prod(grid)
    gen = torch.Generator(device=device).manual_seed(9)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    x, update, qkv = rand(batch, seq, dim), rand(batch, seq, dim), rand(batch, seq, 3 * dim)
    shift, scale, gate = (v for v in (rand(batch, 6, dim, dtype=torch.float32) * 0.3).chunk(6, dim=1)[:3])
    weight, bias = rand(dim, dtype=torch.float32), rand(dim, dtype=torch.float32)
    rope = rope_3d_tables(grid, dim // heads, device=device)
    q, norm_weight = qkv[..., :dim], rand(dim)
    unit = x.numel() * x.element_size()  # bytes of one [B, S, D] activation
    cases = [
        (
            "LN1 + modulation",
            2,
            lambda k: layer_norm_modulate(x, eps=eps, shift=shift, scale=scale, kernel=k),
        ),
        (
            "gated residual + LN2 (affine)",
            4,
            lambda k: residual_layer_norm(x, update, gate, eps=eps, weight=weight, bias=bias, kernel=k),
        ),
        (
            "residual + LN3 + modulation",
            4,
            lambda k: residual_layer_norm(x, update, None, eps=eps, shift=shift, scale=scale, kernel=k),
        ),
        (
            "q RMSNorm + RoPE (stacked qkv)",
            2,
            lambda k: rms_norm_rope(q, norm_weight, eps, heads=heads, rope=rope, kernel=k),
        ),
        ("q RMSNorm (cross)", 2, lambda k: rms_norm_rope(x, norm_weight, eps, heads=heads, kernel=k)),
        ("FFN gated residual", 3, lambda k: add_residual(x, update, gate, kernel=k)),
    ]
    bandwidth = copy_bandwidth(device)
    results = []
    for label, units, fn in cases:
        entry = {"case": label, "floor_ms": units * unit / bandwidth / 1e6}
        try:
            got, want = fn(True), fn(False)
            pairs = zip(got, want, strict=True) if isinstance(got, tuple) else [(got, want)]
            entry["rel_err"] = max(relative_error(a, b) for a, b in pairs)
            for name, flag in (("kernel_ms", True), ("torch_ms", False)):
                _, _, times = timed(lambda fn=fn, flag=flag: fn(flag), device, warmup=3, iters=20)
                entry[name] = statistics.median(times)
        except Exception as err:
            entry["error"] = one_line(err)
        results.append(entry)
    sweeps = []
    for label, launch in (
        (
            "LN1 + modulation",
            lambda r, w: triton_norms.residual_layer_norm(
                x, None, None, None, None, shift, scale, eps, rows=r, num_warps=w
            ),
        ),
        (
            "gated residual + LN2",
            lambda r, w: triton_norms.residual_layer_norm(
                x, update, gate, weight, bias, None, None, eps, rows=r, num_warps=w
            ),
        ),
        (
            "RMSNorm + RoPE",
            lambda r, w: triton_norms.rms_norm_rope(
                q, norm_weight, eps, *rope, dim // heads, rows=r, num_warps=w
            ),
        ),
    ):
        for rows in (2, 4):
            for warps in (4, 8):
                try:
                    _, _, times = timed(lambda r=rows, w=warps, f=launch: f(r, w), device, warmup=2, iters=20)
                    sweeps.append(
                        {"case": label, "rows": rows, "warps": warps, "ms": statistics.median(times)}
                    )
                except Exception as err:
                    sweeps.append({"case": label, "rows": rows, "warps": warps, "error": one_line(err)})
    return {"copy_gbps": bandwidth, "cases": results, "sweeps": sweeps}


def print_row_kernels(bench: dict) -> None:
    print(
        f"\nRow passes at the step's size, bf16 (copy bandwidth {bench['copy_gbps']:.0f} GB/s = the floor's rate)"
    )
    print(f"{'pass':<36} {'floor ms':>8} {'kernel':>8} {'%floor':>7} {'torch':>8} {'rel err':>8}")
    for e in bench["cases"]:
        if "error" in e:
            print(f"{e['case']:<36} {e['error']}")
            continue
        print(
            f"{e['case']:<36} {e['floor_ms']:8.3f} {e['kernel_ms']:8.3f} {100 * e['floor_ms'] / e['kernel_ms']:6.0f}% "
            f"{e['torch_ms']:8.3f} {e['rel_err']:8.1e}"
        )
    print(
        "tile sweep (ms): "
        + "; ".join(
            f"{e['case']} rows {e['rows']} warps {e['warps']}: "
            + (f"{e['ms']:.3f}" if "ms" in e else e["error"])
            for e in bench["sweeps"]
        )
    )


def print_gpu_table(rows: list[Row], sustained: dict[str, dict]) -> None:
    print("\nClocks over the timed calls (NVML, 5 ms samples)")
    print(f"{'what':<40} {'ms':>8} {'SM MHz':>7} {'min':>6} {'W':>5} {'pwrcap':>6} {'slow':>5}")

    def line(label: str, ms: str, gpu: dict) -> None:
        if not gpu:
            print(f"{label:<40} {ms:>8} (no readings)")
            return
        print(
            f"{label:<40} {ms:>8} {gpu['sm_mhz']:7.0f} {gpu['sm_mhz_min']:6.0f} {gpu['power_w']:5.0f} "
            f"{100 * gpu['power_capped']:5.0f}% {100 * gpu['slowdown']:4.0f}%"
        )

    for row in rows:
        if row.ms is not None:
            line(row.label, f"{row.ms:.1f}", row.gpu)
    for label, result in sustained.items():
        if "error" in result:
            print(f"{label:<40} {result['error']}")
            continue
        rates = f"{result['burst_tflops']:.0f}->{result['sustained_tflops']:.0f}"
        line(f"{label} TF/s burst->sustained", rates, result)


def ab_mode(args: argparse.Namespace, device: torch.device) -> dict:
    """Round 1 (torch row passes, three q/k/v GEMMs) against round 2 (Triton row kernels, stacked q/k/v), same weights."""
    config, video = (TINY, (64, 96, 9)) if args.tiny else MODELS[args.model]
    video = (args.height or video[0], args.width or video[1], args.frames or video[2])
    torch._dynamo.config.cache_size_limit = 64  # three compiled variants share the block's code object
    reference, round1 = build_models(config, device)
    round1.set_fused_kernels(False)
    tensors = {name: (t, RANDOM) for name, t in reference.state_dict().items()}

    def copy_model() -> WanDiT:
        return wan_dit_from_tensors(config, tensors, source=RANDOM, dtype=torch.bfloat16, device=device)

    round2 = copy_model().fuse_projections()
    inputs = make_inputs(config, video, device)
    tokens = inputs.tokens
    work = dit_flops(config, 2, tokens, config.text_len)
    print(f"A/B: Wan {config.dim}d x {config.num_layers}, {video} -> {tokens} tokens, batch 2", flush=True)

    truth = None
    if not args.no_fp32 and not args.tiny:
        with torch.no_grad():
            wide = copy.deepcopy(reference).float()
            truth = wide(
                inputs.latents[:1].float(), inputs.timestep[:1], inputs.text[:1].float(), return_dict=False
            )[0]
            del wide

    cuda = device.type == "cuda"
    matmul = matmul_peak(device, 8192) if cuda else float("nan")
    peaks = attention_peaks(device, (2, tokens, config.num_attention_heads, config.attention_head_dim))
    numeric = {k: v for k, v in peaks.items() if isinstance(v, float)}
    best = max(numeric, key=numeric.get) if numeric else "none"
    floor = {
        "attention_kernel": best,
        "attention_tflops": numeric.get(best, float("nan")),
        "matmul_tflops": matmul,
        "attention_ms": work.attention / numeric.get(best, float("nan")) / 1e9,
        "linear_ms": work.linear / matmul / 1e9,
    }
    floor["ms"] = floor["attention_ms"] + floor["linear_ms"]
    print(f"  peaks: matmul {matmul:.0f} TF/s; attention {peaks}", flush=True)

    sustained: dict[str, dict] = {}
    bench: dict = {}
    if cuda:
        shape = (2, tokens, config.num_attention_heads, config.attention_head_dim)
        attention_fn = attention_kernels(device).get(best)
        gen = torch.Generator(device=device).manual_seed(4)
        q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        a = torch.randn(2 * tokens, config.ffn_dim, device=device, dtype=torch.bfloat16, generator=gen)
        b = torch.randn(config.dim, config.ffn_dim, device=device, dtype=torch.bfloat16, generator=gen)
        for label, fn, flops, calls in (
            (f"attention {best}", lambda: attention_fn(q, k, v), 4 * math.prod(shape) * tokens, 60),
            ("GEMM FFN-down", lambda: a @ b.t(), 2 * a.shape[0] * config.ffn_dim * config.dim, 300),
        ):
            try:
                sustained[label] = sustained_rate(fn, device, calls, flops)
            except Exception as err:
                sustained[label] = {"error": one_line(err)}
            print(f"  sustained {label}: {sustained[label]}", flush=True)
        del q, k, v, a, b
        bench = row_kernel_bench(config, inputs, device)
        print_row_kernels(bench)

    impl = FlashAttentionImpl("fa3") if cuda and load_provider("fa3") else SDPAImpl()
    kernel = "fa3" if isinstance(impl, FlashAttentionImpl) else "torch-default"
    sampler = GpuSampler() if cuda else None
    rows: list[Row] = []
    breakdowns: dict[str, dict] = {}
    layouts: dict[str, list] = {}

    def step_of(model: WanDiT) -> Callable[[], torch.Tensor]:
        return lambda: model(inputs.latents, inputs.timestep, inputs.text, attention=impl)

    def mmgen_row(label: str, model: WanDiT, compiled: bool, profile: bool) -> None:
        rows.append(Row(label, "mmgen", kernel, compiled=compiled))
        run_row(rows[-1], step_of(model), device, args, expected, truth, sampler)
        try:
            with torch.no_grad(), LayoutRecorder(impl) as recorder:
                step_of(model)()
            layouts[label] = recorder.seen
        except Exception as err:
            layouts[label] = [one_line(err)]
        if profile and cuda and rows[-1].ms is not None:
            breakdowns[label] = kernel_breakdown(step_of(model), device)

    expected = None
    try:
        reference.reset_attention_backend()
        rows.append(Row(DEFAULT_ROW, "diffusers", "torch-default"))
        expected = run_row(
            rows[-1],
            lambda: reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False)[0],
            device,
            args,
            None,
            truth,
            sampler,
        )
        mmgen_row("mmgen r1 eager (torch rows, 3 GEMMs)", round1, False, False)
        mmgen_row("mmgen r2 eager (triton rows, qkv GEMM)", round2, False, True)
        round1.compile_blocks(fuse=False, backend=args.compile_backend)
        mmgen_row("mmgen r1 compiled (round 1)", round1, True, True)
        round2.compile_blocks(backend=args.compile_backend)
        mmgen_row("mmgen r2 compiled (round 2)", round2, True, True)
        if args.ablation:
            ablation = copy_model()
            ablation.compile_blocks(fuse=False, backend=args.compile_backend)
            mmgen_row("mmgen r2 compiled, 3 q/k/v GEMMs", ablation, True, True)
        if cuda:
            rows += diffusers_backend_rows(
                reference, inputs, device, args, expected, truth, fa2=False, sampler=sampler
            )
        if args.ablation:  # drift check: the two main variants again, last (already compiled)
            mmgen_row("mmgen r1 compiled (again)", round1, True, False)
            mmgen_row("mmgen r2 compiled (again)", round2, True, False)
    except KeyboardInterrupt:
        print("INTERRUPTED: the tables below hold the rows measured so far", flush=True)

    env = versions()
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    header = f"device {name} | " + " | ".join(f"{k} {v}" for k, v in env.items())
    print_step_report(header, rows, work, floor, breakdowns)
    if bench:
        print_row_kernels(bench)
    if cuda:
        print_gpu_table(rows, sustained)
    print("\nWhat reaches the attention kernel (first self- and cross-attention call of a step)")
    for label, seen in layouts.items():
        print(f"{label}:")
        for call in seen:
            print(f"    {call}")
    return {
        "device": name,
        "versions": env,
        "video": video,
        "tokens": tokens,
        "work": asdict(work),
        "floor": floor,
        "attention_peaks": peaks,
        "sustained": sustained,
        "row_kernels": bench,
        "rows": [asdict(row) for row in rows],
        "breakdowns": breakdowns,
        "layouts": layouts,
    }


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, interrupt)  # `timeout` ends a run with SIGTERM: report what was measured
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.tiny:
        sys.exit("no CUDA device: run on a GPU, or pass --tiny for a CPU smoke run")
    if args.ab:
        result = ab_mode(args, device)
    else:
        result = pipeline_mode(args, device) if args.pipeline else step_mode(args, device)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
