"""The `render` and `ab` subcommands. `register(subparsers)` adds them to the `mmgen` parser.

mmgen/cli.py wires them into `mmgen`; also runnable alone: `python -m mmgen.render.cli render FILE.yaml`.
Exit codes: 0 success; 1 a job failed or an --expect was not met; 2 invalid input or a refused A/B.
The face hands `ab` its prompt scorer (the default model's detector, mmgen.tiny.detector): the only
import of mmgen.tiny in mmgen.render, so the comparison machinery knows no model in particular.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mmgen.cli_args import (
    EXIT_ERROR,
    add_parallel_flags,
    add_progress_flags,
    run_command,
)
from mmgen.errors import ValidationError

EXIT_INVALID = EXIT_ERROR  # invalid input or a refused A/B, as `mmgen` reports every MmgenError


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `render` and `ab` to an argparse subparsers object; each sets `func(args) -> exit code`."""
    render = subparsers.add_parser(
        "render",
        help="render every job of a YAML file (resumable; writes manifest.jsonl)",
        description="Render the jobs of a YAML file with one model load. Finished jobs are skipped on a rerun.",
    )
    render.add_argument("file", help="render YAML file (model, defaults, jobs or prompts_file)")
    render.add_argument(
        "--out",
        default=None,
        help="output directory (default: the file's output_dir, else renders/<file stem>)",
    )
    render.add_argument("--no-resume", action="store_true", help="render every job again, even finished ones")
    render.add_argument(
        "--check", action="store_true", help="validate the file and list the jobs, render nothing"
    )
    add_parallel_flags(render, sp_default="1: --gpus N runs N one-GPU groups")
    ray = render.add_argument_group("Ray cluster (pip install mmgen[ray])")
    ray.add_argument(
        "--ray",
        default=None,
        metavar="auto|ADDRESS",
        help="run the jobs on Ray replicas: 'auto' (a running cluster) or its address; this process writes every output",
    )
    ray.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="Ray replicas, each one process with its own pipeline (default 1)",
    )
    add_progress_flags(render)
    render.set_defaults(func=_render_command)

    ab = subparsers.add_parser(
        "ab",
        help="render a baseline and a candidate on the same jobs and compare the frames",
        description=(
            "Compare a baseline render file with a candidate (a second file, or the baseline plus --set key=value). "
            "Writes ab_report.json and a contact sheet per job whose frames differ."
        ),
    )
    ab.add_argument("base", help="baseline render YAML file")
    ab.add_argument("candidate", nargs="?", default=None, help="candidate render YAML file (or use --set)")
    ab.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="candidate setting, e.g. attention_backend=sdpa or dtype=bfloat16 (repeatable)",
    )
    ab.add_argument("--out", default=None, help="output directory (default: ab/<baseline stem>)")
    ab.add_argument(
        "--expect", default=None, help="'lossless' (every SHA equal) or 'psnr>=N'; exit 1 if not met"
    )
    ab.add_argument(
        "--reuse",
        action="store_true",
        help="keep finished jobs already in OUT/base and OUT/candidate (resume)",
    )
    ab.add_argument("--rows", type=int, default=4, help="frames per contact sheet (default 4)")
    ab.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="time the first job cold (by default each side renders its first job once, untimed, first)",
    )
    add_progress_flags(ab)
    ab.set_defaults(func=_ab_command)


def _report_mistakes(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print a render file's mistakes one per line (the generic handler would join them into one)."""

    def command(args: argparse.Namespace) -> int:
        from mmgen.render.schema import RenderConfigError  # imports torch: not at `mmgen --help`

        try:
            return run(args)
        except RenderConfigError as err:
            lines = str(err).splitlines()
            print(f"mmgen: error: {lines[0]}", file=sys.stderr)
            for line in lines[1:]:
                print(f"  {line.strip()}", file=sys.stderr)
            return EXIT_INVALID

    return command


@_report_mistakes
def _render_command(args: argparse.Namespace) -> int:
    # these import torch: not at `mmgen --help`
    from mmgen.render.runner import run_render
    from mmgen.render.schema import load_render_file

    plan = load_render_file(args.file, output_dir=args.out)
    if args.check:
        return _check_command(args, plan)
    gpus = 1 if args.gpus is None else args.gpus
    if args.replicas is not None and args.ray is None:
        raise ValidationError("--replicas needs --ray auto|ADDRESS")
    if args.ray is not None:
        if args.gpus is not None:
            raise ValidationError(
                "--ray: use --replicas N (and --sp/--cfg-parallel for each replica's ranks), not --gpus"
            )
        from mmgen.executors.ray_executor import RayExecutor  # optional: ray
        from mmgen.parallel.layout import ParallelConfig  # torch: not at `mmgen --help`

        layout = ParallelConfig(sp=args.sp or 1, ring=args.ring, cfg=args.cfg_parallel)

        def executor(plan: Any) -> RayExecutor:
            replicas = args.replicas or 1
            return RayExecutor(
                plan.model_spec(), address=args.ray, replicas=replicas, parallel=layout, log=_stderr
            )

        summary = run_render(
            plan, resume=not args.no_resume, show_progress=args.progress, log=_stderr, executor=executor
        )
    elif gpus > 1 or args.sp is not None or args.cfg_parallel:
        from mmgen.render.groups import render_groups, run_render_groups  # torch: not at `mmgen --help`

        config, groups = render_groups(gpus, args.sp, args.ring, args.cfg_parallel)
        summary = run_render_groups(plan, config, groups, resume=not args.no_resume)
    else:
        summary = run_render(plan, resume=not args.no_resume, show_progress=args.progress, log=_stderr)
    print(summary.format(), flush=True)
    return summary.exit_code


def _check_command(args: argparse.Namespace, plan: Any) -> int:
    """`render --check`: list the jobs and what a render would do, including a refusal it would meet."""
    # these import torch: not at `mmgen --help`
    from mmgen.render.manifest import MANIFEST_NAME, read_manifest
    from mmgen.render.runner import check_outputs, pending_jobs

    pending, _ = pending_jobs(plan, plan.output_dir) if not args.no_resume else (list(plan.jobs), {})
    todo = {job.label for job in pending}
    for job in plan.jobs:
        state = "to render" if job.label in todo else "done"
        print(f"{job.label}\tseed {job.seed}\t{state}\t{job.prompt}")
    if pending and plan.output_dir.is_dir():  # what the render would refuse, before it loads a model
        records = read_manifest(plan.output_dir / MANIFEST_NAME)
        check_outputs(plan, pending, records, save_frames=False, replace_others=args.no_resume)
    print(f"{args.file}: valid; {len(plan.jobs)} jobs, {len(todo)} to render into {plan.output_dir}")
    return 0


@_report_mistakes
def _ab_command(args: argparse.Namespace) -> int:
    # Imported here, as the other commands' work: `mmgen --help` loads neither torch nor the pipelines.
    from mmgen.render.ab import run_ab
    from mmgen.tiny.detector import prompt_following_score

    result = run_ab(
        args.base,
        args.candidate,
        sets=args.sets,
        out_dir=args.out,
        expect=args.expect,
        reuse=args.reuse,
        rows=args.rows,
        show_progress=args.progress,
        warmup=args.warmup,
        prompt_scorer=prompt_following_score,  # the default model's detector; ab applies it to that model only
    )
    print(result.format())
    print(f"report: {result.report_path}", flush=True)
    return result.exit_code


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `python -m mmgen.render.cli {render,ab} ...`; errors print as lines, no traceback."""
    parser = argparse.ArgumentParser(prog="mmgen")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
