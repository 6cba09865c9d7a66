"""The `mmgen` command: one entry point, one argparse subcommand per task.

Every MmgenError (and OSError, e.g. an unwritable output) ends the command with exactly one line
"mmgen: error: ..." on stderr and exit code 2, never a traceback. SIGINT and SIGTERM end it with one
line, temp files removed, exit 130 and 143. Results go to stdout as
"key: value" lines; progress bars go to stderr (only on a terminal, unless --progress/--no-progress).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mmgen.cli_args import (
    EXIT_ERROR,
    add_parallel_flags,
    add_progress_flags,
    ending,
    run_command,
)
from mmgen.errors import ValidationError
from mmgen.llm.cli import register as register_enhance
from mmgen.model_flags import DeferredFlagsParser, add_model_flags, given_values
from mmgen.outputs.locations import check_output_file, estimate_output_bytes
from mmgen.progress import NullProgress, TqdmProgress
from mmgen.render.cli import register as register_render
from mmgen.serve.cli import register as register_serve
from pipelines.checks import check_output_path


def main(
    argv: Sequence[str] | None = None, parsed: Callable[[], None] | None = None, ends: bool = False
) -> int:
    """Run `mmgen <subcommand> ...`; returns the exit code (the console script exits with it).

    parsed: called once the command line is parsed (its imports done), before the command runs.
    ends: this process ends when main returns (the console command): `generate --gpus N` then runs
    its rank 0 in this process (mmgen.parallel.lead), whose world is left for the exit to end."""
    argv = list(sys.argv[1:] if argv is None else argv)
    began = time.time()  # wall clock: the ranks of --gpus N (other processes) measure from it too
    # `generate --gpus N`: the rank processes start first, their imports overlapping this parse's
    with early_ranks(argv, leads=ends) as started:
        parser = build_parser()
        args = parser.parse_args(argv)
        if parsed is not None:
            parsed()
        if started is not None and started.leads:  # this process is rank 0: its join of the world begins
            started.join_here()
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            return EXIT_ERROR
        # generate is told when the command began (its `start` seconds) and the ranks started for it
        command = (
            functools.partial(run_generate, started=started, began=began)
            if args.func is run_generate
            else None
        )
        return run_command(args, command)


def early_ranks(argv: Sequence[str], leads: bool = False) -> contextlib.AbstractContextManager[Any]:
    """StartedRanks for `generate --gpus N` (N > 1, no torchrun), read from argv ahead of the parse;
    else a context of None (for one process on a GPU, its CUDA context begun: early_cuda_context).
    They join the world --gpus/--sp/--ring/--cfg-parallel ask for while this process parses. A guess
    the parse disagrees with costs only idle processes, stopped on exit. leads: this process is rank
    0 (it ends when the command does) and N - 1 processes start."""
    if not argv or argv[0] != "generate" or {"-h", "--help"} & set(argv):
        return contextlib.nullcontext()
    # The generate parser's own parallel flags (torch-free), read alone; a bad value is the parse's to say.
    flags = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_parallel_flags(flags, sp_default="all ranks not taken by CFG")
    flags.add_argument("--device", default="auto")
    try:
        known, _ = flags.parse_known_args(argv[1:])
    except argparse.ArgumentError:
        return contextlib.nullcontext()
    # these import no torch
    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port, torchrun_environment
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    if torchrun_environment():  # the ranks exist: this process is one of them
        return contextlib.nullcontext()
    if known.gpus is None or known.gpus < 2:
        early_cuda_context(known.device)
        return contextlib.nullcontext()
    world = EarlyWorld(
        gpus=known.gpus,
        sp=known.sp,
        ring=known.ring,
        cfg=known.cfg_parallel,
        address=f"tcp://127.0.0.1:{free_port()}",
        timeout_s=DEFAULT_TIMEOUT_S,
    )
    end_stuck = _end_stuck if leads else None
    return StartedRanks(known.gpus, RANK_MODULES, device=known.device, world=world, end_stuck=end_stuck)


def early_cuda_context(device: str) -> bool:
    """One process's `generate` on a GPU (--device auto, cuda or cuda:N): the device's CUDA context made
    from now in a thread, beside the imports, as a started rank's is (mmgen.parallel.cuda_context); its
    first CUDA call in the load then finds it made. Whether one is begun (not for cpu or another name;
    where there is no GPU the thread finds no driver and makes nothing)."""
    from mmgen.parallel.cuda_context import start_primary_context  # imports no torch

    kind, _, index = device.partition(":")
    if kind not in ("auto", "cuda") or not (index or "0").isdigit() or (kind == "auto" and index):
        return False
    start_primary_context(int(index or 0))
    return True


def _end_stuck(error: BaseException) -> None:
    """A leading `generate`'s rank 0 waits in a collective with a rank that failed (NCCL: until its
    timeout): the failure's one line and exit 2 now, or for the group's Ctrl-C / SIGTERM "interrupted" /
    "terminated" and 130 / 143, as run_command says them (cli_args.ending; mmgen.parallel.lead)."""
    import os

    line, status = ending(error)
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def build_parser(
    registrars: Sequence[Callable[[argparse._SubParsersAction], None]] | None = None,
) -> argparse.ArgumentParser:
    """The `mmgen` parser with the subcommands each registrar adds (default: `generate`)."""
    parser = argparse.ArgumentParser(
        prog="mmgen", description="Text-to-video / text-to-image with diffusion transformers."
    )
    # a command's generated flags are added when it is used: `mmgen --help` imports no torch
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=DeferredFlagsParser)
    for register in registrars if registrars is not None else default_registrars():
        register(subparsers)
    return parser


def default_registrars() -> tuple[Callable[[argparse._SubParsersAction], None], ...]:
    """Every subcommand of `mmgen`: generate here; render/ab and enhance from their own packages."""
    return (register_generate, register_render, register_enhance, register_serve)


# The options of `mmgen generate` that are not request fields (which model, how to run it, where to
# write), written by hand; every request field's flag is generated from GenerationRequest
# (add_request_flags), the prompt being the positional.
FACE_ONLY_OPTIONS = (
    "model",
    "out",
    "dtype",
    "device",
    "fps",
    "gpus",
    "sp",
    "ring",
    "cfg_parallel",
    "progress",
)
# seed: the Python call draws a fresh random seed by default; the command line uses 0 so that the
# same command gives the same frames (a face default, recorded like any other seed).
SEED_DEFAULT = 0


def register_generate(subparsers: argparse._SubParsersAction) -> None:
    """Add `generate` to an argparse subparsers object."""
    gen = subparsers.add_parser(
        "generate",
        help="generate one video (mp4) or image (png) from a prompt",
        description=(
            "Generate a video (.mp4) or, with --frames 1 or an --out ending in .png, an image (.png). "
            "Without --model it runs the embedded default model (a tiny video model built on first use). "
            "Options left out take the model directory's defaults."
        ),
    )
    gen.add_argument("prompt", help="the text prompt")
    gen.add_argument(
        "--model",
        type=Path,
        default=None,
        help="local model directory of a registered family: diffusers format, or the family's original layout",
    )
    gen.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output .mp4 or .png, replaced if it exists (default ./mmgen_<seed>.mp4, or "
        "./mmgen_<seed>_<n>.mp4 when that file exists: never replaced without --out)",
    )
    gen.add_argument(
        "--dtype",
        default=None,
        help="fp32 | bf16 | fp16 (or float32 | bfloat16 | float16); default fp32 on CPU, bf16 on CUDA",
    )
    gen.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if available"
    )
    gen.add_argument("--fps", type=int, default=None, help="mp4 frame rate (default: the model's)")
    group = gen.add_argument_group("request (pipelines.request.GenerationRequest)")
    if isinstance(gen, DeferredFlagsParser):
        gen.defer(lambda _: add_request_flags(group))
    else:
        add_request_flags(group)
    add_parallel_flags(gen, sp_default="all of --gpus (half with --cfg-parallel)")
    add_progress_flags(gen)
    gen.set_defaults(func=run_generate)


def add_request_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> dict[str, str]:
    """A flag per GenerationRequest field but the positional prompt; returns {field: flag}."""
    from pipelines.request import GenerationRequest  # torch: not at `mmgen --help`
    from pipelines.request_properties import field_flag, field_role

    def help_of(name: str, field: Any) -> str:
        text = field.description or ""
        if name == "seed":  # the face's own default, not the field's
            return (
                text.partition(" (default")[0]
                + f" (default {SEED_DEFAULT}: the same command, the same frames)"
            )
        return f"lossy: {text}" if field_role(name) == "lossy" else text

    return add_model_flags(
        parser,
        GenerationRequest,
        flag_of=field_flag,
        skip=("prompt",),
        defaults={"seed": SEED_DEFAULT},
        help_of=help_of,
    )


def request_flags() -> dict[str, str]:
    """{field: flag} of every request field `mmgen generate` takes (the prompt is its positional)."""
    return add_request_flags(argparse.ArgumentParser(add_help=False))


def parallel_config(args: argparse.Namespace) -> Any:
    """The ParallelConfig of --gpus/--sp/--ring/--cfg-parallel (one process when none is given)."""
    from mmgen.executors.launch import flags_config  # imports torch: not at `mmgen --help`

    return flags_config(args.gpus, args.sp, args.cfg_parallel, args.ring)


def generate_request(args: argparse.Namespace) -> Any:
    """The GenerationRequest of the command line, built once; an error names the flag of each bad field."""
    # these import torch: not at `mmgen --help`
    from mmgen.render.face_request import build_request
    from pipelines.request import GenerationRequest
    from pipelines.request_properties import field_flag

    fields = given_values(args, GenerationRequest, request_flags())
    # the prompt is the positional: its errors name it as "prompt", the others by their flag
    return build_request(
        {"prompt": args.prompt, **fields}, spell=lambda name: name if name == "prompt" else field_flag(name)
    )


def _joined(value: str | list[str]) -> str:
    return " ".join(value) if isinstance(value, list) else value


def run_generate(args: argparse.Namespace, started: Any = None, began: float | None = None) -> int:
    """`mmgen generate`: check the request, load the model, generate, write the file, print its identity.

    started: the StartedRanks of --gpus N spawned before the parse (main), or None. began: time.time()
    when the command started (main; default now): the `start` seconds count from it."""
    # these import torch: not at `mmgen --help`
    from mmgen.families import makes_images
    from pipelines.loader import check_dtype

    # Every check that needs no model first, so a typo never waits for a model load.
    request = generate_request(args)
    if args.dtype is not None:
        _with_flag("dtype", check_dtype, args.dtype)  # either spelling; resolve_dtype names it once
    dtype = args.dtype or "auto"
    if args.fps is not None and args.fps < 1:
        raise ValidationError(f"--fps = {args.fps}: must be >= 1")
    # A model of an image family (the registry says which) makes one frame: a PNG unless --out says otherwise.
    image_model = makes_images(args.model)
    png = (request.num_frames == 1 or image_model) if args.out is None else args.out.suffix.lower() == ".png"
    frames = 1 if png and request.num_frames is None else request.num_frames
    out = args.out or fresh_output_path(request.seed, png)
    check_output_path(out, 1 if frames is None else frames)
    _check_output_location(out, frames, request.height, request.width)
    if args.model is not None and not args.model.is_dir():
        what = "a file, expected a model directory" if args.model.is_file() else "directory not found"
        raise ValidationError(f"--model {str(args.model)!r}: {what}")
    config = parallel_config(args)

    # these import torch: not at `mmgen --help`
    from mmgen.executors.launch import launch
    from pipelines.loader import resolve_device

    device = resolve_device(args.device)
    run = GenerateRun(request, out, png, device, dtype, time.time() if began is None else began)
    # the devices and the model's head count are checked before any model loads
    # settles: a started rank's world joins while its weights load (the loader settles the layout)
    lines = launch(
        generate_on_rank,
        config,
        device.partition(":")[0],
        args.model,
        args,
        run,
        started=started,
        settles=True,
    )
    if lines:
        print("\n".join(lines))
    return 0


@dataclass(frozen=True)
class GenerateRun:
    """What run_generate decided before any model loads, handed to each rank."""

    request: Any  # GenerationRequest
    out: Path
    png: bool  # one frame into a .png (the T2I pipeline)
    device: str
    dtype: str  # a dtype name or "auto"
    # time.time() when the command started (default: when this was made): "start" seconds count from it
    began: float = field(default_factory=time.time)


def fresh_output_path(seed: int | None, png: bool, directory: Path = Path()) -> Path:
    """./mmgen_<seed>.mp4 (or .png), or the first ./mmgen_<seed>_<n> that does not exist yet.

    Without --out nothing is replaced: a second prompt with the same seed gets its own file.
    """
    suffix = ".png" if png else ".mp4"
    path = directory / f"mmgen_{seed}{suffix}"
    count = 1
    while path.exists():
        path = directory / f"mmgen_{seed}_{count}{suffix}"
        count += 1
    return path


# What a rank of `generate --gpus N` imports before its work: generate_on_rank's module and what it runs
# (a StartedRanks process imports them while the launcher parses).
RANK_MODULES = (
    "mmgen.parallel.launch",
    "mmgen.cli",
    "pipelines.request",
    "mmgen.executors.group_link",
    "mmgen.executors.in_process",
    "mmgen.families",
)


def generate_on_rank(layout: Any, args: argparse.Namespace, run: GenerateRun) -> list[str]:
    """Load, generate and (rank 0 only) write the output; the result lines rank 0 prints, [] elsewhere.

    layout: this rank's ParallelLayout, None in one process, or a PendingLayout (its world still
    joining: the loader settles it after reading the weights, mmgen.parallel.launch.settled).

    The job runs through an in-process executor (mmgen.executors.in_process). Over several ranks rank
    0's executor leads and the others follow it (mmgen.executors.group_link, as the ranks of a render
    group or of `mmgen serve --gpus` do): they run the same call and leave it at the same progress
    report as rank 0."""
    # these import torch: not at `mmgen --help`
    from mmgen.executors.group_link import GroupLink, follow
    from mmgen.executors.in_process import InProcessExecutor, load_pipeline
    from mmgen.executors.jobs import JobSpec, ModelSpec
    from mmgen.parallel.launch import PendingLayout

    request = run.request
    spec = ModelSpec(
        model="default" if args.model is None else str(args.model),
        task="t2i" if run.png else "t2v",
        device=run.device,
        dtype=run.dtype,
        offload=request.offload,
        gpu_memory_gb=request.gpu_memory_gb,
    )
    start = time.time() - run.began  # imports and the parse (a started rank joins its world beside the load)
    tick = time.perf_counter()
    pipe = load_pipeline(spec, parallel=layout)
    load = time.perf_counter() - tick
    # of the load, the wait for a started rank's world (its join outlasting the weights' read)
    world_wait = {"world_wait": layout.waited_s} if isinstance(layout, PendingLayout) else {}
    if not pipe.layout.owns_outputs:
        follow(pipe, pipe.layout)
        return []
    link = None if pipe.layout.is_single else GroupLink(pipe.layout)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    executor = InProcessExecutor(
        spec, lambda: pipe, progress=lambda job: TqdmProgress() if show else NullProgress(), link=link
    )
    try:  # the one request value, checked once
        with executor, contextlib.closing(executor.run([JobSpec(0, None, request)])) as rendered_jobs:
            rendered = next(rendered_jobs)
            if link is not None:
                # the other ranks' part is done (the decoded frames are this rank's): they return and
                # report while this one writes the output, then wait for its end (standby.end_after_launcher)
                link.stop()
            path, export = _write_output(rendered, run.out, args.fps)
    finally:
        if link is not None:  # (after a failure) the other ranks return rather than wait for a job
            link.stop()
    count, height, width, _ = rendered.frames.shape
    # start and load are rank 0's own (another rank still loading shows in rank 0's first stage)
    timings = {"start": start, "load": load, **world_wait, **rendered.stage_timings, "export": export}
    lines = [
        f"output: {path}",
        f"frames_sha256: {rendered.frames_sha256}",
        f"latents_sha256: {rendered.latents_sha256}",
        *(  # one sha256, or one per image (several images), space-separated
            f"{name}_sha256: {_joined(rendered.args[name + '_sha256'])}"
            for name in ("image", "video", "mask", "reference_images")
            if name + "_sha256" in rendered.args
        ),
        f"attention: {', '.join(sorted(set(rendered.attention_providers.values())))}",
        f"frames: {count} x {height}x{width}" + ("" if run.png else f" at {args.fps or rendered.fps} fps"),
        # Never silent about sizes the user did not give: the image's aspect rule, the variant's defaults.
        *([f"size: {rendered.args['size_rule']}"] if rendered.args.get("size_rule") else []),
        *([f"defaults: {rendered.args['defaults']}"] if "defaults" in rendered.args else []),
        *([f"parallel: {pipe.layout.describe()}"] if not pipe.layout.is_single else []),
        *([f"preset: {request.preset}"] if request.preset is not None else []),
        *_describe_lossy(rendered.args),
    ]
    if "loras" in rendered.args:
        from mmgen.lora.report import describe  # imports torch: not at `mmgen --help`

        lines.append(f"lora_mode: {rendered.args['loras']['mode']}")
        lines.extend(f"lora: {line}" for line in describe(rendered.args["loras"]))
    peaks = ", ".join(f"{name} {gib:.2f}" for name, gib in rendered.memory_gib.items())
    lines += [
        "seconds: " + ", ".join(f"{name} {seconds:.2f}" for name, seconds in timings.items()),
        _describe_plan(rendered.args["memory_plan"]),
        f"peak_gpu_gib: {peaks or 'n/a (not on CUDA)'}",
    ]
    return lines


def _write_output(rendered: Any, out: Path, fps: int | None) -> tuple[Path, float]:
    """Write a generated job's frames at `out` (the pipeline's atomic writer; the job's bar shows the
    export); its failure raised (an unexpected one after its traceback). Returns the path and seconds."""
    if rendered.traceback is not None:  # an unexpected error (no MmgenError): where it arose
        print(rendered.traceback, file=sys.stderr, end="")
    rendered.raise_failure()
    for warning in rendered.args.get("warnings", ()):  # a setting the model did not apply
        print(f"mmgen: warning: {warning}", file=sys.stderr)
    tick = time.perf_counter()
    progress = rendered.progress
    progress.stage("export", 1)
    path = rendered.save(out, fps=fps)
    progress.advance()
    return path, time.perf_counter() - tick


def _describe_plan(plan: dict) -> str:
    lossy = " (lossy)" if plan["lossy"] else ""
    budget = "" if plan["budget_gib"] is None else f" budget {plan['budget_gib']:g} GiB"
    note = f" ({plan['note']})" if plan.get("note") else ""  # e.g. offload on a CPU device does nothing
    return (
        f"memory_plan: offload {plan['offload']}, cfg {plan['cfg']}, ffn_chunk {plan['ffn_chunk'] or 'off'}, "
        f"block_chunk {plan.get('block_chunk') or 'off'}, decode {plan['decode']}{lossy}{budget}{note}"
    )


def _describe_lossy(args: dict) -> list[str]:
    """The lossy settings a result was made with (none for a lossless result), as the fields declare them."""
    from pipelines.request_properties import lossy_args  # imports torch: not at `mmgen --help`

    lines = []
    for name in lossy_args():
        if name not in args:
            continue
        if name == "step_cache_reused":
            lines.append(f"{name}: {len(args[name])} steps {args[name]}")
        elif name == "accel_skipped":
            lines.extend(f"accel skipped {part}: {reason}" for part, reason in args[name].items())
        else:
            lines.append(f"{name}: {args[name]}")
    return lines


def _check_output_location(out: Path, frames: int | None, height: int | None, width: int | None) -> None:
    # Before the model loads: a directory in the way, an unwritable directory or a clearly full disk
    # is one line now, not an encoder error after the whole generation. An existing file is replaced.
    needed = 0
    if frames is not None and height is not None and width is not None:  # else the model's defaults decide
        needed = estimate_output_bytes(out.suffix, frames, height, width)
    check_output_file(out, needed_bytes=needed)


def _with_flag(flag: str, check: Callable[[Any], Any], value: object) -> Any:
    # The pipeline's checks name its arguments; on the command line, name the flag too.
    try:
        return check(value)
    except ValidationError as err:
        raise ValidationError(f"--{flag}: {err}") from err


def console() -> None:
    """The `mmgen` command (pyproject's script, `python -m mmgen.cli`): main(), then its exit status.

    The garbage collector is off while the command line is parsed: the parse imports torch and the
    request (about a million objects that live as long as the process), and the collector's full
    passes over them freed nothing and took ~0.25 s of a ~2.3 s `generate` on 2 CPU cores. Once parsed,
    those objects are set aside for good (gc.freeze) and the collector runs again, for the work's.

    Once `generate` has returned, its output is published and its lines printed; the interpreter's
    own teardown after it (freeing torch's modules and its libraries' static objects) does nothing the
    command needs and took ~0.6 s of a ~2.8 s run on 2 CPU cores. So generate ends at once, its
    streams flushed, unless a non-daemon thread still runs (then the usual exit waits for it). Its
    rank processes (`--gpus N`) have reported by then and are not waited for: they end after this
    process (mmgen.parallel.standby.end_after_launcher), their teardown (a GPU's memory given back)
    after its own, not beside it. Other commands
    end the usual way (their exit hooks: a Ray client's shutdown, a server's)."""
    import gc
    import os
    import threading

    def collect_from_now() -> None:
        gc.freeze()
        gc.enable()

    argv = sys.argv[1:]
    gc.disable()
    status = main(argv, parsed=collect_from_now, ends=True)
    sys.stdout.flush()
    sys.stderr.flush()
    others = [
        thread
        for thread in threading.enumerate()
        if not thread.daemon and thread is not threading.current_thread()
    ]
    if argv[:1] == ["generate"] and not others:
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    console()
