"""The `mmgen` command: one entry point, one argparse subcommand per task.

Every MmgenError (and OSError, e.g. an unwritable output) ends the command with exactly one line
"mmgen: error: ..." on stderr and exit code 2, never a traceback. SIGINT and SIGTERM end it with one
line, temp files removed, exit 130 and 143. Results go to stdout as
"key: value" lines; progress bars go to stderr (only on a terminal, unless --progress/--no-progress).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mmgen.cli_args import (
    EXIT_ERROR,
    add_parallel_flags,
    add_progress_flags,
    run_command,
)
from mmgen.errors import ValidationError

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def main(argv: Sequence[str] | None = None) -> int:
    """Run `mmgen <subcommand> ...`; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    return run_command(args)


def build_parser(
    registrars: Sequence[Callable[[argparse._SubParsersAction], None]] | None = None,
) -> argparse.ArgumentParser:
    """The `mmgen` parser with the subcommands each registrar adds (default: `generate`)."""
    parser = argparse.ArgumentParser(
        prog="mmgen", description="Text-to-video / text-to-image with Wan-architecture models."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in registrars if registrars is not None else default_registrars():
        register(subparsers)
    return parser


def default_registrars() -> tuple[Callable[[argparse._SubParsersAction], None], ...]:
    """Every subcommand of `mmgen`: generate here; render/ab and enhance from their own packages."""
    from mmgen.llm.cli import register as register_enhance
    from mmgen.render.cli import register as register_render
    from mmgen.serve.cli import register as register_serve

    return (register_generate, register_render, register_enhance, register_serve)


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` to an argparse subparsers object."""
    gen = subparsers.add_parser(
        "generate",
        help="generate one video (mp4) or image (png) from a prompt",
        description=(
            "Generate a video (.mp4) or, with --frames 1 or an --out ending in .png, an image (.png). "
            "Without --model it runs the embedded default model (a tiny Wan built on first use). "
            "Options left out take the model directory's defaults."
        ),
    )
    gen.add_argument("prompt", help="the text prompt")
    gen.add_argument("--model", type=Path, default=None, help="local diffusers-format Wan directory")
    gen.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output .mp4 or .png, replaced if it exists (default ./mmgen_<seed>.mp4)",
    )
    gen.add_argument("--frames", type=int, default=None, help="frame count, 4k+1 (1 = an image)")
    gen.add_argument("--height", type=int, default=None, help="pixels, a multiple of 16")
    gen.add_argument("--width", type=int, default=None, help="pixels, a multiple of 16")
    gen.add_argument("--steps", type=int, default=None, help="denoising steps (>= 1)")
    gen.add_argument(
        "--seed", type=int, default=0, help="noise seed (default 0: the same command, the same frames)"
    )
    gen.add_argument("--guidance", type=float, default=None, help="classifier-free guidance scale (>= 0)")
    gen.add_argument("--negative-prompt", default=None, help="what to steer away from")
    gen.add_argument(
        "--backend", default="auto", help="attention: auto, sdpa, flash, flash:fa3|fa4|fa2|reference"
    )
    gen.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="fp32 on CPU, bf16 on CUDA by default"
    )
    gen.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available"
    )
    gen.add_argument("--fps", type=int, default=None, help="mp4 frame rate (default: the model's)")
    gen.add_argument(
        "--image",
        type=Path,
        default=None,
        help="conditioning image (PNG/JPEG/WebP) for I2V / TI2V models; without --height/--width it sets the size",
    )
    gen.add_argument(
        "--offload",
        choices=("none", "model", "layer"),
        default=None,
        help="weights on the GPU only while they run: model (whole components), layer (DiT and text "
        "encoder layers streamed from pinned host memory); default none, or planned by --gpu-memory-gb",
    )
    gen.add_argument(
        "--gpu-memory-gb",
        type=float,
        default=None,
        help="GPU memory budget in GiB: picks the least offloading that fits (error if nothing does)",
    )
    gen.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="PATH[:STRENGTH][@EXPERT]",
        help="apply a LoRA (.safetensors; repeatable); @0/@1 picks a Wan2.2 expert",
    )
    gen.add_argument("--lora-mode", choices=("fused", "unfused"), default="fused", help="default: fused")
    gen.add_argument(
        "--lora-allow-unmatched", action="store_true", help="apply LoRAs even if some keys match no weight"
    )
    gen.add_argument("--preset", default=None, help="named settings, e.g. distill-4step (4 steps, no CFG)")
    gen.add_argument(
        "--step-cache",
        type=float,
        default=None,
        metavar="THRESHOLD",
        help="lossy: reuse a step's DiT outputs while the accumulated timestep-signal change stays "
        "below THRESHOLD (0 = exact); off by default",
    )
    gen.add_argument(
        "--cfg-truncation",
        type=float,
        default=None,
        metavar="FRACTION",
        help="lossy: keep CFG for the first FRACTION of the steps, then the conditional branch only "
        "(1.0 = exact); off by default",
    )
    gen.add_argument(
        "--accel",
        default=None,
        help="lossy speed-up presets named by cost: fast (step caching + CFG truncation), fastest (more "
        "of both); both add FP8 linears and attention where native (CUDA, FP8 GPU); see RESULTS.md 12",
    )
    gen.add_argument(
        "--fp8-linear",
        action="store_true",
        default=None,
        help="lossy: run the DiT's linear layers in FP8 e4m3 where it pays (Ada/Hopper GPUs, bf16 "
        "model; emulated elsewhere); off by default",
    )
    gen.add_argument(
        "--fp8-attention",
        action="store_true",
        default=None,
        help="lossy: self-attention on FP8 e4m3 q/k/v through FA3's FP8 forward (Hopper, backend flash "
        "with fa3-fwd; emulated elsewhere); off by default",
    )
    add_parallel_flags(gen, sp_default="all of --gpus (half with --cfg-parallel)")
    add_progress_flags(gen)
    gen.set_defaults(func=run_generate)


def parallel_config(args: argparse.Namespace) -> Any:
    """The ParallelConfig of --gpus/--sp/--ring/--cfg-parallel (one process when none is given)."""
    import os

    from mmgen.parallel.layout import ParallelConfig

    gpus = args.gpus if args.gpus is not None else int(os.environ.get("WORLD_SIZE", 1))
    return ParallelConfig.for_gpus(gpus, sp=args.sp, cfg=args.cfg_parallel, ring=args.ring)


def run_generate(args: argparse.Namespace) -> int:
    """`mmgen generate`: check the request, load the model, generate, write the file, print its identity."""
    from pipelines.checks import (
        check_attention_backend,
        check_guidance,
        check_num_frames,
        check_output_path,
        check_seed,
        check_size,
        check_steps,
    )

    # Model-independent checks first, so a typo never waits for a model load.
    for name, value, check in (
        ("height", args.height, lambda v: check_size("height", v)),
        ("width", args.width, lambda v: check_size("width", v)),
        ("frames", args.frames, check_num_frames),
        ("steps", args.steps, check_steps),
        ("guidance", args.guidance, check_guidance),
    ):
        if value is not None:
            _with_flag(name, check, value)
    _with_flag("seed", check_seed, args.seed)
    if args.fps is not None and args.fps < 1:
        raise ValidationError(f"--fps = {args.fps}: must be >= 1")
    image = args.frames == 1 if args.out is None else args.out.suffix.lower() == ".png"
    frames = 1 if image and args.frames is None else args.frames
    out = _output_path(args, image)
    check_output_path(out, 1 if frames is None else frames)
    _check_output_location(out, frames, args.height, args.width)
    if args.model is not None and not args.model.is_dir():
        what = "a file, expected a model directory" if args.model.is_file() else "directory not found"
        raise ValidationError(f"--model {str(args.model)!r}: {what}")
    if args.image is not None:
        from pipelines.image_input import read_image

        read_image(args.image, field="--image")  # a missing or unreadable image fails before the model loads
    from mmgen.placement.policy import check_budget

    _with_flag("gpu-memory-gb", check_budget, args.gpu_memory_gb)
    _with_flag("backend", check_attention_backend, args.backend)  # the one check that imports torch
    _lora_requests(args)  # bad --lora values and missing files fail before any model loads
    config = parallel_config(args)

    from mmgen.parallel.launch import (
        check_devices,
        layout_from_environment,
        run_parallel,
        torchrun_environment,
    )
    from pipelines.loader import check_parallel_model, resolve_device

    device = resolve_device(args.device)
    device_type = device.partition(":")[0]
    check_devices(config, device_type)  # before any model loads
    check_parallel_model(args.model, config)  # the head count too, from the model's config.json
    if torchrun_environment():
        lines = generate_on_rank(layout_from_environment(config, device_type), args, image, frames, device)
    elif config.world_size > 1:
        lines = run_parallel(generate_on_rank, config, args, image, frames, device, device_type=device_type)
    else:
        lines = generate_on_rank(None, args, image, frames, device)
    if lines:
        print("\n".join(lines))
    return 0


def generate_on_rank(
    layout: Any, args: argparse.Namespace, image: bool, frames: int | None, device: str
) -> list[str]:
    """Load, generate and (rank 0 only) write the output; the result lines rank 0 prints, [] elsewhere."""
    from pipelines.loader import load_pipeline, resolve_dtype

    dtype = resolve_dtype(DTYPES[args.dtype] if args.dtype else "auto", device)
    pipe = load_pipeline(
        args.model,
        task="t2i" if image else "t2v",
        device=device,
        dtype=dtype,
        offload=args.offload,
        gpu_memory_gb=args.gpu_memory_gb,
        parallel=layout,
    )
    owner = pipe.layout.owns_outputs
    loras = _lora_requests(args)

    from mmgen.progress import NullProgress, TqdmProgress

    show = sys.stderr.isatty() if args.progress is None else args.progress
    progress = TqdmProgress() if show and owner else NullProgress()
    try:
        result = pipe(
            args.prompt,
            args.negative_prompt,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance,
            seed=args.seed,
            attention_backend=args.backend,
            progress=progress,
            lora=loras,
            lora_mode=args.lora_mode,
            lora_allow_unmatched=args.lora_allow_unmatched,
            preset=args.preset,
            step_cache=args.step_cache,
            cfg_truncation=args.cfg_truncation,
            accel=args.accel,
            fp8_linear=args.fp8_linear,
            fp8_attention=args.fp8_attention,
            **({} if image else {"num_frames": frames}),
            **({} if args.image is None else {"image": args.image}),
        )
        if not owner:
            return []
        out = _output_path(args, image)
        tick = time.perf_counter()
        progress.stage("export", 1)
        path = result.save(out, fps=args.fps)
        progress.advance()
        export = time.perf_counter() - tick
    finally:
        progress.close()
    count, height, width, _ = result.frames.shape
    timings = {**result.timings, "export": export}
    lines = [
        f"output: {path}",
        f"frames_sha256: {result.frames_sha256}",
        f"latents_sha256: {result.latents_sha256}",
        *([f"image_sha256: {result.args['image_sha256']}"] if "image_sha256" in result.args else []),
        f"attention: {', '.join(sorted(set(result.attention_providers.values())))}",
        f"frames: {count} x {height}x{width}" + ("" if image else f" at {args.fps or result.fps} fps"),
        # Never silent about sizes the user did not give: the image's aspect rule, the variant's defaults.
        *([f"size: {result.args['size_rule']}"] if result.args.get("size_rule") else []),
        *([f"defaults: {result.args['defaults']}"] if "defaults" in result.args else []),
        *([f"parallel: {pipe.layout.describe()}"] if not pipe.layout.is_single else []),
        *([f"preset: {args.preset}"] if args.preset is not None else []),
        *_describe_lossy(result.args),
    ]
    if "loras" in result.args:
        from mmgen.lora.report import describe

        lines.append(f"lora_mode: {result.args['loras']['mode']}")
        lines.extend(f"lora: {line}" for line in describe(result.args["loras"]))
    peaks = ", ".join(f"{name} {gib:.2f}" for name, gib in result.memory.items())
    lines += [
        "seconds: " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in timings.items()),
        _describe_plan(result.args["memory_plan"]),
        f"peak_gpu_gib: {peaks or 'n/a (not on CUDA)'}",
    ]
    return lines


def _output_path(args: argparse.Namespace, image: bool) -> Path:
    """--out, or ./mmgen_<seed>.png / .mp4."""
    return args.out or Path(f"mmgen_{args.seed}{'.png' if image else '.mp4'}")


def _describe_plan(plan: dict) -> str:
    lossy = " (lossy)" if plan["lossy"] else ""
    budget = "" if plan["budget_gib"] is None else f" budget {plan['budget_gib']:g} GiB"
    return (
        f"memory_plan: offload {plan['offload']}, cfg {plan['cfg']}, ffn_chunk {plan['ffn_chunk'] or 'off'}, "
        f"block_chunk {plan.get('block_chunk') or 'off'}, decode {plan['decode']}{lossy}{budget}"
    )


def _describe_lossy(args: dict) -> list[str]:
    """The lossy settings a result was made with (none for a lossless result)."""
    names = ("accel", "step_cache", "cfg_truncation", "fp8_linear", "fp8_linear_layers", "fp8_attention")
    lines = [f"{name}: {args[name]}" for name in names if name in args]
    if "step_cache_reused" in args:
        lines.append(f"step_cache_reused: {len(args['step_cache_reused'])} steps {args['step_cache_reused']}")
    for name, reason in args.get("accel_skipped", {}).items():
        lines.append(f"accel skipped {name}: {reason}")
    return lines


def _lora_requests(args: argparse.Namespace) -> list:
    """--lora values as LoRARequests; a bad value or a missing file is an error before any model loads."""
    from mmgen.lora import LoRARequest
    from pipelines.presets import check_preset

    _with_flag("preset", check_preset, args.preset)
    _check_lossy_flags(args)
    requests = [LoRARequest.parse(text) for text in args.lora]
    for request in requests:
        if not request.path.is_file():
            raise ValidationError(f"--lora {str(request.path)!r}: file not found")
    return requests


def _check_lossy_flags(args: argparse.Namespace) -> None:
    from pipelines.step_cache import check_accel, check_cfg_truncation, check_step_cache, resolve_accel

    _with_flag("step-cache", check_step_cache, args.step_cache)
    _with_flag("cfg-truncation", check_cfg_truncation, args.cfg_truncation)
    _with_flag("accel", check_accel, args.accel)
    resolve_accel(args.accel, args.step_cache, args.cfg_truncation, args.fp8_linear, args.fp8_attention)


def _check_output_location(out: Path, frames: int | None, height: int | None, width: int | None) -> None:
    # Before the model loads: a directory in the way, an unwritable directory or a clearly full disk
    # is one line now, not an encoder error after the whole generation. An existing file is replaced.
    from mmgen.outputs.locations import check_output_file, estimate_output_bytes

    needed = 0
    if frames is not None and height is not None and width is not None:  # else the model's defaults decide
        needed = estimate_output_bytes(out.suffix, frames, height, width)
    check_output_file(out, needed_bytes=needed)


def _with_flag(flag: str, check: Callable[[object], object], value: object) -> None:
    # The pipeline's checks name its arguments; on the command line, name the flag too.
    try:
        check(value)
    except ValidationError as err:
        raise ValidationError(f"--{flag}: {err}") from err


if __name__ == "__main__":
    sys.exit(main())
