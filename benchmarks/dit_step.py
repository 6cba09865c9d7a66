"""One Wan denoising step (cond + uncond, batch 2) on one GPU: mmgen against diffusers, same weights.

Run from the repository root on a CUDA machine with diffusers (fa3-fwd and flash-attn-4 optional):

    python3 benchmarks/dit_step.py                     # Wan2.1-T2V-1.3B, 480x832x81 (32,760 tokens)
    python3 benchmarks/dit_step.py --model 14b         # Wan2.1-T2V-14B, 720x1280x81 (75,600 tokens)
    python3 benchmarks/dit_step.py --tiny              # CPU smoke run of the harness (tiny config)

The whole pipeline is benchmarks/pipeline_e2e.py. Modes whose questions are answered in
benchmarks/RESULTS.md were removed from this script (history: git log --follow benchmarks/dit_step.py):
the round-1/round-2 A/B with clocks, burst vs sustained rates, row-pass byte floors, tile sweeps and
q/k/v strides (`--ab`, `--ablation`, section 4) and the GELU-epilogue check and unfused-GELU row
(sections 2-3).

Random bf16 weights go into diffusers' WanTransformer3DModel (norms, modulation tables and the time
MLP kept fp32, as its from_pretrained does) and, tensor for tensor, into mmgen's WanDiT
(benchmarks/wan_models.py). Rows: mmgen with each attention provider found (FA3 through fa3-fwd,
FA4, cuDNN SDPA, SDPA flash = FA2 inside torch; SDPA forced with torch.nn.attention.sdpa_kernel),
eager and with WanDiT.compile_blocks(); diffusers under its default attention, `_native_cudnn`,
`_native_flash`, its `_flash_3` backend pointed at fa3-fwd (the same FA3 kernel mmgen calls) and
`_native_flash` after torch's activate_flash_attention_impl("FA4") (the same FA4 kernel), plus
diffusers' default called as its WanPipeline does (two batch-1 calls). Attempts that cannot run say why.

Printed: ms per step (median of --iters after warm-up, CUDA events), spread, ratio to the floor and
to each diffusers variant, achieved TFLOP/s, output error against diffusers' default bf16 output
(max abs, relative L2) and against a diffusers fp32 forward of the conditional sample, the peak GPU
memory a row allocates above the weights, first-call seconds (compilation included). The floor
counts attention FLOPs (4 S^2 d per head and layer for self-attention, 4 S L d for cross-attention)
at the measured attention peak (the fastest FA kernel at the Wan shape) plus linear FLOPs (2 x
params x tokens) at the measured bf16 matmul peak (8192^3). A kernel-time breakdown
(torch.profiler) splits chosen rows into attention, GEMM, fused (inductor) and other kernels, and
the launch gaps (step time minus kernel time).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from bench_utils import (  # noqa: E402
    attention_peaks,
    bench_device,
    device_name,
    environment_header,
    floor_ms,
    kernel_breakdown,
    matmul_peak,
    max_abs,
    one_line,
    relative_error,
    sdpa_forced,
    timed,
    versions,
    write_json,
)
from wan_models import add_model_args, build_models, model_and_video  # noqa: E402

from mmgen.attention import FlashAttentionImpl, SDPAImpl  # noqa: E402
from mmgen.kernels.fa_providers import probe_provider as load_provider  # noqa: E402
from mmgen.models.wan import WanConfig, WanDiT  # noqa: E402

SAME_KERNEL = {
    "fa3": "diffusers _flash_3 (fa3-fwd)",
    "fa4": "diffusers _native_flash+torch FA4",
    "cudnn": "diffusers _native_cudnn",
    "fa2": "diffusers _native_flash",
}


DEFAULT_ROW = "diffusers default"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row (eager; compiled: +1)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled mmgen rows")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for the blocks")
    parser.add_argument("--no-fp32", action="store_true", help="skip the diffusers fp32 reference forward")
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel-time breakdown")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


# ----------------------------------------------------------------------------------------------
# FLOPs and inputs


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
) -> torch.Tensor | None:
    """Time fn into row (errors are recorded, not raised); returns its output."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    warmup = args.warmup + (1 if row.compiled else 0)
    try:
        with torch.no_grad():
            out, row.first_s, row.times = timed(fn, device, warmup=warmup, iters=args.iters)
    except Exception as err:  # one failing variant must not end the run
        row.error = one_line(err)
        print(f"  {row.label}: FAILED {row.error}", flush=True)
        return None
    row.ms = statistics.median(row.times)
    if device.type == "cuda":
        row.peak_gib = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if expected is not None:
        row.max_abs, row.rel_err = max_abs(out, expected), relative_error(out, expected)
    if truth is not None:
        row.rel_fp32 = relative_error(out[: truth.shape[0]], truth)
    print(f"  {row.label}: {row.ms:.1f} ms (first {row.first_s:.1f} s)", flush=True)
    return out


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
        attention_dispatch.flash_attn_3_func = provider.lib.flash_attn_func
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
) -> list[Row]:
    """Diffusers with its attention backend set to cuDNN, FA2 (torch) and FA3 (fa3-fwd)."""
    rows: list[Row] = []

    def forward() -> torch.Tensor:
        return reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False)[0]

    backends = [
        ("diffusers _native_cudnn", "_native_cudnn", "cudnn"),
        ("diffusers _native_flash", "_native_flash", "fa2"),
    ]
    for label, backend, kernel in backends:
        rows.append(Row(label, "diffusers", kernel))
        reference.set_attention_backend(backend)
        run_row(rows[-1], forward, device, args, expected, truth)

    rows.append(Row(SAME_KERNEL["fa3"], "diffusers", "fa3"))
    why = point_diffusers_flash3_at_fa3_fwd()
    if why is None:
        try:
            reference.set_attention_backend("_flash_3")
            run_row(rows[-1], forward, device, args, expected, truth)
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


def _mmgen_step(model: WanDiT, inputs: Inputs, variant: tuple) -> Callable[[], torch.Tensor]:
    _, _, impl, forced = variant

    def step() -> torch.Tensor:
        with sdpa_forced(forced):
            return model(inputs.latents, inputs.timestep, inputs.text, attention=impl)

    return step


# ----------------------------------------------------------------------------------------------
# report

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
# the step


def step_mode(args: argparse.Namespace, device: torch.device) -> dict:
    config, video = model_and_video(args)
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
    floor = floor_ms(work.attention, work.linear, matmul, peaks)
    print(f"  peaks: matmul {peak_size}^3 bf16 {matmul:.0f} TF/s; attention {peaks}", flush=True)

    rows: list[Row] = []
    breakdowns: dict[str, dict] = {}
    profile_here = not args.no_profile and device.type == "cuda"
    first = mmgen_variants(device)[0]
    try:  # most wanted rows first; an interrupt (SIGTERM from a time limit) still prints what was measured
        default_rows, expected = diffusers_rows(reference, inputs, device, args, truth)
        rows += default_rows
        rows += mmgen_rows(model, inputs, device, args, expected, truth, compiled=False)
        if profile_here:
            breakdowns[DEFAULT_ROW] = kernel_breakdown(
                lambda: reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False),
                device,
                kernel_category,
            )
            breakdowns[f"mmgen {first[0]} eager"] = kernel_breakdown(
                _mmgen_step(model, inputs, first), device, kernel_category
            )
        if not args.no_compile:
            model.compile_blocks(backend=args.compile_backend)
            rows += mmgen_rows(model, inputs, device, args, expected, truth, compiled=True)
            if profile_here:
                breakdowns[f"mmgen {first[0]} compiled"] = kernel_breakdown(
                    _mmgen_step(model, inputs, first), device, kernel_category
                )
        if device.type == "cuda":
            rows += diffusers_backend_rows(reference, inputs, device, args, expected, truth)
            rows += torch_flash_rows(reference, inputs, device, args, expected, truth)
    except KeyboardInterrupt:
        print("INTERRUPTED: the tables below hold the rows measured so far", flush=True)

    print_step_report(environment_header(device), rows, work, floor, breakdowns)
    return {
        "device": device_name(device),
        "versions": versions(),
        "video": video,
        "tokens": tokens,
        "work": asdict(work),
        "floor": floor,
        "attention_peaks": peaks,
        "rows": [asdict(row) for row in rows],
        "breakdowns": breakdowns,
    }


def main() -> None:
    args = parse_args()
    write_json(args.json, step_mode(args, bench_device(args.tiny)))


if __name__ == "__main__":
    main()
