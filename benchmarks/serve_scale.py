"""How many jobs an hour, at what latency, does `mmgen serve` give on several GPUs of one host? (issue 38)

For each server layout, one after another on the same model directory and the same jobs:

    1        `mmgen serve` on one GPU (the reference: every other layout's SHAs are compared with it)
    u2, u4   `mmgen serve --gpus N`: one replica, Ulysses over N ranks (scale_out.py's layout names:
             cfg2, cfg2xu2, u4r2 ... as `--cfg-parallel`, `--ring`)
    ray2     `mmgen serve --ray ADDRESS --replicas N`: N one-GPU replicas on a local Ray cluster (this
             host alone) that this script starts first and shuts down after

the server is started (its stdout/stderr kept per layout), awaited until /health is ok (bounded),
warmed up with W untimed jobs per replica (each replica's first job: CUDA and NCCL start-up, kept out
of the rows), then CLIENTS threads share JOBS jobs, each like the openai client's create_and_poll
(serve_load.py's clients: submit one, poll it until it ends, submit the next). Prints one table: the
GPUs the layout takes (--tiny: CPU processes), the server's start (until /health is ok) and warm-up
seconds, the jobs phase's wall seconds and jobs per hour, end-to-end latency p50/p99 (POST to the
poll that saw it completed, up to one poll late), queue wait p50/p99 (the server's: submitted -> claimed), the median pipeline seconds of a job, jobs lost,
5xx answers, and how many jobs' frames_sha256 / latents_sha256 equal layout 1's same job (same
request, same seed); for Ray layouts the jobs each replica ran (/metrics). One layout failing (it
does not fit, a rank dies) leaves the others to run; every wait is bounded; every server is stopped
on the way out, also on SIGTERM (`timeout`), which prints the layouts measured so far.

On GPUs (a random-weight Wan2.1-1.3B directory written first, reduced text encoder; kept and reused
in DIR), as `bash benchmarks/gpu_session.sh serve_scale_2gpu` runs it:

    python3 benchmarks/serve_scale.py --make-random wan13b /tmp/mmgen-wan13b-scale --layouts 1,u2,ray2 \\
        --size 832x480 --frames 33 --steps 4 --jobs 16 --clients 8 --warmup 1 --json serve_scale.json

CPU smoke run of the whole flow (a tiny random directory, gloo ranks for uN, CPU Ray replicas):

    python3 benchmarks/serve_scale.py --tiny --layouts 1,u2,ray2 --jobs 8 --clients 4
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench_utils import environment_header, print_table, report_on_sigterm, write_json
from checkout import checkout_pythonpath
from scale_out import parse_layout, write_model
from serve_load import (
    SERVE_DTYPES,
    job_bodies,
    percentile,
    run_clients,
    running_server,
    serve_command,
    warm_up,
    warmup_bodies,
)

RAY_LAYOUT = re.compile(r"ray(?P<replicas>\d+)")
RELEASE_TIMEOUT_S = 60  # a stopped server's Ray replicas give their CPUs/GPUs back within this


def layout_flags(name: str) -> tuple[tuple[str, ...], int, int]:
    """A layout name -> (its `mmgen serve` flags, replicas, GPUs it takes). '1', 'u2', 'cfg2xu2', 'u4r2'
    (scale_out.py's names) or 'rayN' (N one-GPU Ray replicas; ADDRESS filled in by the caller)."""
    ray = RAY_LAYOUT.fullmatch(name)
    if ray is not None and int(ray["replicas"]) >= 1:
        replicas = int(ray["replicas"])
        return ("--replicas", str(replicas)), replicas, replicas
    try:
        config = parse_layout(name)
    except SystemExit:
        raise SystemExit(f"--layouts: {name!r} is not a layout (1, uN, cfg2, cfg2xuN, uNrM, rayN)") from None
    flags = () if config.world_size == 1 else ("--gpus", str(config.world_size))
    if config.world_size > 1:
        flags += ("--sp", str(config.sp), "--ring", str(config.ring))
        flags += ("--cfg-parallel",) if config.cfg else ()
    return flags, 1, config.world_size


def start_ray(replicas: int, device: str) -> str:
    """A new local Ray cluster (this host only) for `replicas` one-CPU (one-GPU on CUDA) replicas; its GCS
    address. Its workers inherit this process's PYTHONPATH (this checkout first)."""
    import ray
    import torch

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    # Ray advertises the host's own address even when asked for 127.0.0.1 (resolve_ip_for_localhost);
    # the servers' HTTP stays on loopback.
    ray.init(
        address="local",  # a new cluster here, never one a stale ray_current_cluster file names
        num_cpus=replicas,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    print(f"Ray: a local cluster of {replicas} CPUs, {gpus} GPUs at {ray.get_runtime_context().gcs_address}")
    return ray.get_runtime_context().gcs_address


def wait_released() -> None:
    """Until every CPU and GPU of the local cluster is free again (a stopped server's replicas end
    asynchronously), at most RELEASE_TIMEOUT_S."""
    import ray

    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    total = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
    while time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0.0) >= v for k, v in total.items()):
            return
        time.sleep(0.5)
    print(f"Ray: resources not all free after {RELEASE_TIMEOUT_S} s: {ray.available_resources()}")


def replica_jobs(url: str) -> dict[str, float]:
    """Jobs per replica, as the server's /metrics counts them (empty without replicas, or no answer)."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            text = response.read().decode()
    except OSError:  # urllib's errors included: the server gone, its jobs' figures are still kept
        return {}
    found = re.findall(r'^mmgen_replica_jobs_total\{replica="([^"]+)"\} (\S+)$', text, re.M)
    return {replica: float(value) for replica, value in found}


def run_layout(name: str, args: argparse.Namespace, model: Path, work: Path, ray_address: str | None) -> dict:
    """Start the layout's server, warm it up, run the jobs from the clients; what they measured."""
    flags, replicas, gpus = layout_flags(name)
    if RAY_LAYOUT.fullmatch(name):
        flags = ("--ray", str(ray_address), *flags)
    bodies = job_bodies(args.jobs, args.steps, args.size, args.frames)
    warmup = warmup_bodies(args.warmup * replicas, args.steps, args.size, args.frames)
    folder = work / name
    folder.mkdir()
    command = serve_command(folder / "state", model=model, device=args.device, dtype=args.dtype,
                            max_queue=len(bodies) + len(warmup) + 1, extra=flags)  # fmt: skip
    print(f"--- {name}: {' '.join(command[3:])}", flush=True)
    with running_server(command, folder, args.ready_timeout_s) as (_, url, ready_s):
        warm = warm_up(url, warmup, replicas, args.poll_s, args.timeout_s)
        run = run_clients(url, bodies, args.clients, args.poll_s, args.timeout_s)
        per_replica = replica_jobs(url)
    completed = {i: job for i, job in run.finished.items() if job["status"] == "completed"}
    return {
        "layout": name,
        "flags": list(flags),
        "gpus": gpus,
        "ready_s": ready_s,
        "warmup_s": warm.wall_s,
        "wall_s": run.wall_s,
        "completed": len(completed),
        "lost": args.jobs - len(completed),
        "5xx": sum(status >= 500 for status in warm.statuses + run.statuses),
        "no_answer": sum(status == 0 for status in warm.statuses + run.statuses),
        "latency_s": {i: run.latency_s[i] for i in completed},
        "queue_wait_s": {i: job["timings"].get("queue_wait") for i, job in completed.items()},
        "pipeline_s": {i: job["timings"].get("total") for i, job in completed.items()},
        "frames_sha256": {i: job["frames_sha256"] for i, job in completed.items()},
        "latents_sha256": {i: job["latents_sha256"] for i, job in completed.items()},
        "parallel": sorted({str((job.get("request") or {}).get("parallel")) for job in completed.values()}),
        "job_errors": sorted(
            {str(job.get("error")) for job in run.finished.values() if job["status"] != "completed"}
        ),
        "replica_jobs": per_replica,
    }


def equal_to(result: dict, reference: dict | None, key: str) -> str:
    """'k/n': of this layout's n completed jobs, k have the reference's `key` for the same job."""
    if reference is None:
        return "-"
    same = sum(reference[key].get(i) == sha for i, sha in result[key].items())
    return f"{same}/{len(result[key])}"


def table_row(result: dict, reference: dict | None) -> list[Any]:
    if "error" in result:
        return [result["layout"], *["-"] * 14, "failed"]
    latency = list(result["latency_s"].values())
    waits = [w for w in result["queue_wait_s"].values() if w is not None]
    pipeline = [p for p in result["pipeline_s"].values() if p is not None]
    return [
        result["layout"],
        result["gpus"],
        f"{result['ready_s']:.1f}",
        f"{result['warmup_s']:.1f}",
        f"{result['wall_s']:.1f}",
        f"{3600 * result['completed'] / result['wall_s']:.0f}",
        f"{percentile(latency, 0.5):.2f}",
        f"{percentile(latency, 0.99):.2f}",
        f"{percentile(waits, 0.5):.2f}",
        f"{percentile(waits, 0.99):.2f}",
        f"{statistics.median(pipeline):.2f}" if pipeline else "-",
        result["lost"],
        result["5xx"],
        equal_to(result, reference, "frames_sha256"),
        equal_to(result, reference, "latents_sha256"),
        "ok",
    ]


COLUMNS = [("layout", 8), ("GPUs", 5), ("start s", 8), ("warm s", 7), ("wall s", 7), ("jobs/h", 7), ("e2e p50", 8),
           ("e2e p99", 8), ("wait p50", 9), ("wait p99", 9), ("pipe s", 7), ("lost", 5), ("5xx", 4),
           ("frames=1", 9), ("latents=1", 10), ("", 7)]  # fmt: skip


def print_results(results: list[dict], args: argparse.Namespace) -> None:
    reference = next((r for r in results if r["layout"] == "1" and "error" not in r), None)
    print(f"\n{args.jobs} jobs of {args.size} x {args.frames} frames x {args.steps} steps, {args.clients} clients, "
          f"{args.warmup} warm-up job(s) per replica; {args.device} {args.dtype}; frames=1 / latents=1: "
          "jobs whose sha256 equals layout 1's same job")  # fmt: skip
    print_table(COLUMNS, [table_row(r, reference) for r in results])
    for result in results:
        if "error" in result:
            print(f"{result['layout']}: {result['error']}")
        elif result["replica_jobs"]:
            jobs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(result["replica_jobs"].items()))
            print(f"{result['layout']}: jobs per replica (warm-up included): {jobs}")
        elif result["parallel"] != ["None"]:
            print(f"{result['layout']}: parallel {', '.join(result['parallel'])}")
        if result.get("job_errors"):
            print(f"{result['layout']}: jobs that did not complete: {'; '.join(result['job_errors'])[:500]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layouts", default="1,u2,ray2", help="comma list: 1, uN, cfg2, cfg2xuN, uNrM, rayN")
    parser.add_argument("--model", type=Path, help="a Wan T2V directory (diffusers format)")
    parser.add_argument("--make-random", nargs=2, metavar=("KIND", "DIR"), help="write a random bf16 "
                        "directory first (scale_out.py's kinds: wan13b, wan14b, a14b) and use it; kept "
                        "and reused if DIR holds one")  # fmt: skip
    parser.add_argument("--text-encoder", choices=("reduced", "full"), default="reduced",
                        help="--make-random's text encoder (wan_models.TEXT_ENCODERS; full = UMT5-XXL)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny random directory, CPU "
                        "devices (gloo ranks, CPU Ray replicas)")  # fmt: skip
    parser.add_argument("--size", help="WxH of every job (default 832x480; --tiny 96x64)")
    parser.add_argument("--frames", type=int, help="frames of every job, 4k + 1 (default 33; --tiny 9)")
    parser.add_argument("--steps", type=int, help="denoising steps (default 4; --tiny 2)")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1, help="untimed jobs per replica before the jobs")
    parser.add_argument("--ready-timeout-s", type=float, default=300, help="per server: start to /health ok")
    parser.add_argument("--timeout-s", type=float, default=300, help="per layout: the warm-up, then the jobs")
    parser.add_argument("--poll-s", type=float, default=0.1, help="each client's poll interval")
    parser.add_argument("--json", type=Path, default=None, help="every figure, written after each layout")
    args = parser.parse_args()
    args.layouts = args.layouts.split(",")
    for name in args.layouts:
        layout_flags(name)  # a bad name ends the run here, before anything starts
    args.size = args.size or ("96x64" if args.tiny else "832x480")
    args.frames = args.frames or (9 if args.tiny else 33)
    args.steps = args.steps or (2 if args.tiny else 4)
    args.device = "cpu" if args.tiny else "cuda"
    args.dtype = "float32" if args.tiny else "bfloat16"
    assert args.dtype in SERVE_DTYPES
    return args


def main() -> int:
    args = parse_args()
    report_on_sigterm()  # `timeout`: KeyboardInterrupt, so the servers stop and the table prints
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on GPUs, or pass --tiny for a CPU smoke run")
    print(environment_header(torch.device(args.device)), flush=True)
    # The servers, their ranks and the Ray replicas import this checkout.
    os.environ["PYTHONPATH"] = checkout_pythonpath()
    if args.tiny:  # one torch thread per process (as the tests run): layouts compare on 2 shared cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = write_model(args, args.device)
    ray_replicas = [layout_flags(n)[1] for n in args.layouts if RAY_LAYOUT.fullmatch(n)]
    results: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="mmgen-serve-scale-"))
    try:
        address = None
        if ray_replicas:
            address = start_ray(max(ray_replicas), args.device)
            report_on_sigterm()  # ray.init put its own SIGTERM handler (exit) in place of this one
        for name in args.layouts:
            try:
                results.append(run_layout(name, args, model, work, address))
            except (SystemExit, AssertionError, OSError) as err:  # one layout failing leaves the others
                lines = str(err).strip().splitlines() or [type(err).__name__]
                results.append({"layout": name, "error": lines[-1][:300], "detail": str(err)[-3000:]})
            if address is not None:
                wait_released()
            write_json(args.json, {"args": vars(args), "model": model, "results": results})
    except KeyboardInterrupt:
        print("interrupted (SIGTERM / Ctrl-C): the layouts measured so far", flush=True)
    finally:
        if ray_replicas:
            import ray

            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        if args.tiny and args.make_random is None:
            shutil.rmtree(model, ignore_errors=True)
    print_results(results, args)
    if args.make_random is not None:
        print(f"model: {model} (random weights; text encoder {args.text_encoder})")
    return 0 if results and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
