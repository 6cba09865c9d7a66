"""One Wan denoising step (cond + uncond, batch 2) on one GPU: mmgen against diffusers and the floor.

Run from the repository root on a CUDA machine with diffusers (fa3-fwd and flash-attn-4 optional;
benchmarks/README.md says how to bring them):

    python3 benchmarks/dit_step.py                     # Wan2.1-T2V-1.3B, 480x832x81 (32,760 tokens)
    python3 benchmarks/dit_step.py --model 14b         # Wan2.1-T2V-14B, 720x1280x81 (75,600 tokens)
    python3 benchmarks/dit_step.py --tiny              # CPU smoke run of the harness (tiny config)

Random bf16 weights go into diffusers' WanTransformer3DModel (norms, modulation tables and the time
MLP kept fp32, as its from_pretrained does) and, tensor for tensor, into mmgen's WanDiT
(wan_models.build_models). Rows: diffusers' default attention, batched and as its WanPipeline calls
it (two batch-1 calls); mmgen with each attention provider found (FA3 through fa3-fwd, FA4, cuDNN SDPA,
SDPA flash = FA2 inside torch), eager and with WanDiT.compile_blocks(); diffusers on `_native_cudnn`,
`_native_flash` and its `_flash_3` backend pointed at fa3-fwd (the FA3 kernel mmgen calls).

Printed: ms per step (median of --iters after warm-up, CUDA events), spread, ratio to the floor and
to diffusers (default, cuDNN, same kernel), achieved TFLOP/s, output error against diffusers' default
output (max abs, relative L2), the peak memory a row allocates above the weights, first-call seconds.
The floor counts attention FLOPs (4 S^2 d per head and layer for self-attention, 4 S L d for
cross-attention) at the measured attention peak plus linear FLOPs (2 x params x tokens) at the
measured bf16 matmul peak (8192^3). Answered and removed (git history, RESULTS.md 1-4): the fp32
reference column, the torch.profiler kernel breakdown, diffusers on torch's FA3/FA4 flash impl.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
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
    matmul_peak,
    max_abs,
    print_table,
    relative_error,
    sdpa_forced,
    timed,
    versions,
    write_json,
)
from wan_models import Inputs, add_model_args, build_models, dit_flops, make_inputs, model_and_video  # noqa: E402

from mmgen.attention import FlashAttentionImpl, SDPAImpl  # noqa: E402
from mmgen.errors import one_line  # noqa: E402
from mmgen.kernels.fa_providers import probe_provider as load_provider  # noqa: E402
from mmgen.models.wan import WanDiT  # noqa: E402

DEFAULT_ROW = "diffusers default"
SAME_KERNEL = {
    "fa3": "diffusers _flash_3 (fa3-fwd)",
    "cudnn": "diffusers _native_cudnn",
    "fa2": "diffusers _native_flash",
}
DIFFUSERS_BACKENDS = (("_native_cudnn", "cudnn"), ("_native_flash", "fa2"), ("_flash_3", "fa3"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--iters", type=int, default=3, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per row (eager; compiled: +1)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled mmgen rows")
    parser.add_argument("--json", type=Path, help="also write every number to this JSON file")
    return parser.parse_args()


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
    error: str | None = None


def run_row(row: Row, fn: Callable[[], torch.Tensor], device, args, expected) -> torch.Tensor | None:
    """Time fn into row (errors are recorded, not raised); returns its output."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        with torch.no_grad():
            out, row.first_s, row.times = timed(
                fn, device, warmup=args.warmup + row.compiled, iters=args.iters
            )
    except Exception as err:  # one failing variant must not end the run
        row.error = one_line(err, typed=True)
        print(f"  {row.label}: FAILED {row.error}", flush=True)
        return None
    row.ms = statistics.median(row.times)
    if device.type == "cuda":
        row.peak_gib = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    if expected is not None:
        row.max_abs, row.rel_err = max_abs(out, expected), relative_error(out, expected)
    print(f"  {row.label}: {row.ms:.1f} ms (first {row.first_s:.1f} s)", flush=True)
    return out


def point_diffusers_flash3_at_fa3_fwd() -> None:
    """Make diffusers' `_flash_3` backend call fa3-fwd's FA3 (it imports `flash_attn_interface`)."""
    provider = load_provider("fa3")
    if provider is None:
        raise RuntimeError("fa3-fwd not installed")
    from diffusers.models import attention_dispatch

    if not getattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", False):
        # Same signature (the FA3 beta interface); fa3-fwd just ships it under another module name.
        attention_dispatch.flash_attn_3_func = provider.lib.flash_attn_func
        attention_dispatch._CAN_USE_FLASH_ATTN_3 = True


def diffusers_rows(reference, inputs: Inputs, device, args) -> tuple[list[Row], torch.Tensor | None]:
    """Diffusers' default attention, batched and as WanPipeline calls it; rows and the batched output."""

    def forward(latents=inputs.latents, timestep=inputs.timestep, text=inputs.text) -> torch.Tensor:
        return reference(latents, timestep, text, return_dict=False)[0]

    def as_pipeline() -> torch.Tensor:  # WanPipeline calls the transformer once for cond, once for uncond
        halves = [
            forward(inputs.latents[i : i + 1], inputs.timestep[i : i + 1], inputs.text[i : i + 1])
            for i in (0, 1)
        ]
        return torch.cat(halves)

    reference.reset_attention_backend()
    rows = [
        Row(DEFAULT_ROW, "diffusers", "torch-default"),
        Row(f"{DEFAULT_ROW}, 2x batch 1", "diffusers", "torch-default"),
    ]
    expected = run_row(rows[0], forward, device, args, None)
    if expected is not None:
        rows[0].max_abs, rows[0].rel_err = 0.0, 0.0
    run_row(rows[1], as_pipeline, device, args, expected)
    return rows, expected


def diffusers_backend_rows(reference, inputs: Inputs, device, args, expected) -> list[Row]:
    """Diffusers with its attention backend set to cuDNN, FA2 (torch) and FA3 (fa3-fwd)."""
    rows = []
    for backend, kernel in DIFFUSERS_BACKENDS:
        rows.append(Row(SAME_KERNEL[kernel], "diffusers", kernel))
        try:
            if backend == "_flash_3":
                point_diffusers_flash3_at_fa3_fwd()
            reference.set_attention_backend(backend)
        except Exception as err:
            rows[-1].error = one_line(err, typed=True)
            continue
        run_row(rows[-1], lambda: reference(inputs.latents, inputs.timestep, inputs.text, return_dict=False)[0], device, args, expected)  # fmt: skip
    reference.reset_attention_backend()
    return rows


def mmgen_variants(device: torch.device) -> list[tuple[str, str, object, str | None]]:
    """(label suffix, kernel, impl, forced SDPA backend) for every attention path that runs here."""
    if device.type != "cuda":
        return [("sdpa", "torch-default", SDPAImpl(), None), ("flash:reference", "reference", FlashAttentionImpl("reference"), None)]  # fmt: skip
    variants = [
        (f"flash:{name}", name, FlashAttentionImpl(name), None)
        for name in ("fa3", "fa4")
        if load_provider(name)
    ]
    return variants + [("sdpa:cudnn", "cudnn", SDPAImpl(), "cudnn"), ("sdpa:flash", "fa2", SDPAImpl(), "fa2")]


def mmgen_rows(model: WanDiT, inputs: Inputs, device, args, expected, *, compiled: bool) -> list[Row]:
    rows = []
    for suffix, kernel, impl, forced in mmgen_variants(device):
        rows.append(
            Row(f"mmgen {suffix} {'compiled' if compiled else 'eager'}", "mmgen", kernel, compiled=compiled)
        )

        def step(impl=impl, forced=forced) -> torch.Tensor:
            with sdpa_forced(forced):
                return model(inputs.latents, inputs.timestep, inputs.text, attention=impl)

        run_row(rows[-1], step, device, args, expected)
    return rows


def print_report(rows: list[Row], work, floor: dict) -> None:
    by_label = {row.label: row for row in rows}
    print(
        f"FLOPs per step: self-attn {work.self_attn / 1e12:.1f} T, cross-attn {work.cross_attn / 1e12:.2f} T, "
        f"linear {work.linear / 1e12:.1f} T; floor {floor['ms']:.0f} ms = attention {floor['attention_ms']:.0f} "
        f"ms at {floor['attention_tflops']:.0f} TF/s ({floor['attention_kernel']}) + linear "
        f"{floor['linear_ms']:.0f} ms at {floor['matmul_tflops']:.0f} TF/s"
    )

    def ratio(base: Row | None, row: Row) -> str:
        return f"{base.ms / row.ms:.2f}" if base is not None and base.ms else "-"

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    cells = []
    for row in rows:
        if row.ms is None:
            cells.append((row.label, row.error or "not run", *[""] * 10))
            continue
        spread = (max(row.times) - min(row.times)) / row.ms
        same = by_label.get(SAME_KERNEL.get(row.kernel, "")) if row.family == "mmgen" else None
        cells.append((
            row.label, f"{row.ms:.1f}", f"{100 * spread:.1f}%", f"{row.ms / floor['ms']:.2f}",
            ratio(by_label.get(DEFAULT_ROW), row), ratio(by_label.get(SAME_KERNEL["cudnn"]), row), ratio(same, row),
            f"{work.total / row.ms / 1e9:.0f}", num(row.max_abs, ".2e"), num(row.rel_err, ".2e"),
            num(row.peak_gib, ".1f"), num(row.first_s, ".1f"),
        ))  # fmt: skip
    columns = [
        ("variant", 36),
        ("ms", 8),
        ("sprd", 5),
        ("xfloor", 6),
        ("vs def", 6),
        ("vs cdn", 6),
        ("vs same", 7),
    ]
    columns += [("TF/s", 5), ("max abs", 8), ("rel err", 8), ("+GiB", 5), ("1st s", 6)]
    print_table(columns, cells)
    print(
        "(vs def / vs cdn / vs same: diffusers default / _native_cudnn / same-kernel ms over this row's ms; "
        "max abs, rel err: vs diffusers default bf16; +GiB: peak memory above the weights and inputs)"
    )


def step_rows(args: argparse.Namespace, device: torch.device) -> dict:
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
    matmul = matmul_peak(device, 8192) if device.type == "cuda" else float("nan")
    peaks = attention_peaks(device, (2, tokens, config.num_attention_heads, config.attention_head_dim))
    floor = floor_ms(work.attention, work.linear, matmul, peaks)
    print(f"  peaks: matmul 8192^3 bf16 {matmul:.0f} TF/s; attention {peaks}", flush=True)
    rows: list[Row] = []
    try:  # most wanted rows first; an interrupt (SIGTERM from a time limit) still prints what was measured
        default_rows, expected = diffusers_rows(reference, inputs, device, args)
        rows += default_rows
        rows += mmgen_rows(model, inputs, device, args, expected, compiled=False)
        if not args.no_compile:
            model.compile_blocks()
            rows += mmgen_rows(model, inputs, device, args, expected, compiled=True)
        if device.type == "cuda":
            rows += diffusers_backend_rows(reference, inputs, device, args, expected)
    except KeyboardInterrupt:
        print("INTERRUPTED: the table below holds the rows measured so far", flush=True)
    print("\n" + environment_header(device))
    print_report(rows, work, floor)
    return {
        "device": device_name(device),
        "versions": versions(),
        "video": video,
        "tokens": tokens,
        "work": asdict(work),
        "floor": floor,
        "attention_peaks": peaks,
        "rows": [asdict(row) for row in rows],
    }


def main() -> None:
    args = parse_args()
    write_json(args.json, step_rows(args, bench_device(args.tiny)))


if __name__ == "__main__":
    main()
