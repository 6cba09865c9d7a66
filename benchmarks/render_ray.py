"""What does a Ray replica cost per job, and what do 2 replicas give, for `mmgen render --ray`? (issue 29)

Renders the same JOBS jobs (the default model, on the CPU) three times from empty output
directories: in this process, on 1 Ray replica and on 2, on a local Ray cluster of --cpus CPUs
started here (loopback). Startup (model load; for Ray also actor start) is timed apart from the jobs
phase. Prints one table: startup s, jobs-phase s, jobs/s, and the Ray overhead per job in ms (1
replica's jobs phase minus the in-process one, over JOBS: scheduling, object store, the driver's
writes are in both). Every run's frames SHAs must equal the in-process ones (checked).

    python3 benchmarks/render_ray.py [--jobs 12] [--steps 4] [--size 64] [--cpus 2] [--json out.json]

Each replica asks Ray for 1 CPU and Ray runs it with 1 torch thread; the in-process render is run
with 1 thread too (torch.set_num_threads(1)), so the difference is Ray's and the driver's.

On GPUs (one replica per GPU; the in-process render on cuda:0), a random-weight Wan2.1-1.3B
directory written first (benchmarks/wan_models.write_random_wan_dir):

    python3 benchmarks/render_ray.py --device cuda --gpus 2 --make-random-wan13b /tmp/wan13b \
        --size 832x480 --frames 33 --steps 4 --jobs 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench_utils import print_table, write_json
from checkout import checkout_pythonpath

from mmgen.executors.ray_executor import RayExecutor
from mmgen.render.runner import run_render
from mmgen.render.schema import load_render_file


class TimedStart:
    """An executor wrapper that times its start (__enter__) apart from its jobs."""

    def __init__(self, inner):
        self.inner = inner
        self.start_s = 0.0

    @property
    def load_seconds(self) -> float:
        return self.inner.load_seconds

    def __enter__(self):
        start = time.perf_counter()
        self.inner.__enter__()
        self.start_s = time.perf_counter() - start
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def run(self, jobs):
        return self.inner.run(jobs)


def render(config: Path, out: Path, make) -> tuple[float, float, dict[str, str]]:
    """(startup s, jobs-phase s, frames SHA per job) of one render into `out`."""
    timed: list[TimedStart] = []

    def executor(plan):
        timed.append(TimedStart(make(plan)))
        return timed[-1]

    start = time.perf_counter()
    summary = run_render(load_render_file(config, output_dir=out), show_progress=False, executor=executor)
    wall = time.perf_counter() - start
    assert not summary.failed, summary.format()
    shas = {o.job.label: o.record["frames_sha256"] for o in summary.outcomes}
    return timed[0].start_s, wall - timed[0].start_s, shas


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", default="64", help="S or WxH pixels")
    parser.add_argument("--frames", type=int, default=9)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: one replica per GPU")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs of the local Ray cluster (--device cuda)")
    parser.add_argument("--model", default="default", help="a model directory (default: the embedded model)")
    parser.add_argument("--make-random-wan13b", type=Path, default=None, metavar="DIR",
                        help="write a random-weight Wan2.1-1.3B directory (reduced text encoder) and use it")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import ray
    import torch

    from mmgen.executors.in_process import InProcessExecutor

    if args.make_random_wan13b is not None:
        from wan_models import write_random_wan_dir

        made = write_random_wan_dir(args.make_random_wan13b, text_encoder="reduced", device=args.device)
        print(f"wrote {made['dit']} with random weights in {made['seconds']:.1f} s", flush=True)
        args.model = str(args.make_random_wan13b)
    width, _, height = args.size.partition("x")
    height = height or width
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    torch.set_num_threads(1)  # as Ray runs each 1-CPU replica

    work = Path(tempfile.mkdtemp(prefix="render-ray-"))
    config = work / "batch.yaml"
    jobs = "\n".join(f"  - {{name: j{i}, prompt: a shape number {i}, seed: {i}}}" for i in range(args.jobs))
    config.write_text(
        textwrap.dedent(f"""\
        model: {args.model}
        device: {args.device}
        dtype: {dtype}
        defaults: {{height: {height}, width: {width}, num_frames: {args.frames}, num_inference_steps: {args.steps}}}
        jobs:
        """)
        + jobs
        + "\n"
    )
    rows, result = (
        [],
        {"jobs": args.jobs, "steps": args.steps, "size": args.size, "cpus": args.cpus, "gpus": args.gpus},
    )
    base_start, base_jobs, base_shas = render(
        config, work / "inproc", lambda plan: InProcessExecutor(plan.model_spec(), show_progress=False)
    )
    rows.append(("in-process", f"{base_start:.2f}", f"{base_jobs:.2f}", f"{args.jobs / base_jobs:.2f}", "-"))
    result["in_process"] = {"startup_s": base_start, "jobs_s": base_jobs}
    ray.init(
        address="local",  # a new cluster here, never one a stale ray_current_cluster file names
        num_cpus=args.cpus,
        num_gpus=args.gpus,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        # The replicas import this checkout (and whatever PYTHONPATH holds here: the GPU bundles).
        runtime_env={"env_vars": {"PYTHONPATH": checkout_pythonpath()}},
    )
    try:
        for replicas in (1, 2) if args.gpus < 3 else (1, 2, args.gpus):
            start_s, jobs_s, shas = render(
                config,
                work / f"ray{replicas}",
                lambda plan, n=replicas: RayExecutor(plan.model_spec(), replicas=n),
            )
            assert shas == base_shas, f"{replicas} replicas: frames SHAs differ from the in-process render"
            overhead = (jobs_s - base_jobs) / args.jobs * 1000 if replicas == 1 else None
            rows.append(
                (
                    f"ray x{replicas}",
                    f"{start_s:.2f}",
                    f"{jobs_s:.2f}",
                    f"{args.jobs / jobs_s:.2f}",
                    "-" if overhead is None else f"{overhead:.0f}",
                )
            )
            result[f"ray{replicas}"] = {
                "startup_s": start_s,
                "jobs_s": jobs_s,
                "overhead_ms_per_job": overhead,
            }
    finally:
        ray.shutdown()
    print(
        f"model {args.model}, {args.device} {dtype}, {args.jobs} jobs of {width}x{height}x{args.frames}, "
        f"{args.steps} steps; Ray cluster of {args.cpus} CPUs, {args.gpus} GPUs; frames SHAs equal in every run"
    )
    print_table([("run", 12), ("startup s", 10), ("jobs s", 8), ("jobs/s", 8), ("Ray ms/job", 10)], rows)
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
