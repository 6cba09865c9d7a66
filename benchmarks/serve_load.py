"""Does `mmgen serve` lose, corrupt or slow jobs under concurrent load? (issue 27's load test)

Runs the same jobs twice on one model (the embedded default model on the CPU, or --model DIR):
1. direct: one process loads the pipeline and calls it job after job (`pipe(**fields)` + save);
2. served: `mmgen serve` in a subprocess on 127.0.0.1 and a free port; CLIENTS threads share the
   jobs, each like the openai client's create_and_poll: submit one, poll it every --poll-s until it
   ends, submit the next (so up to CLIENTS jobs wait in the queue).
Prints one table: jobs lost, 5xx answers, frames_sha256 mismatches against the direct run, queue
wait p50/p99, the server's own per-job overhead (the worker's job time minus the pipeline and
export), served / direct throughput, and the server's RSS before and after.

    python3 benchmarks/serve_load.py [--jobs 200] [--clients 16] [--steps 2] [--json out.json]

On a model directory (--warmup N untimed jobs first in both phases: CUDA kernels, allocator):

    python3 benchmarks/serve_load.py --model DIR --device cuda --dtype bfloat16 --size 832x480 \
        --frames 33 --steps 4 --jobs 8 --clients 8 --warmup 1

--make-random-wan13b DIR first writes a random-weight Wan2.1-T2V-1.3B directory there (and uses it
as --model): the real DiT, VAE and UMT5-XXL sizes (--text-encoder reduced: a labelled 2-layer UMT5 of
the same width); with --tiny a tiny one (CPU smoke runs of the whole flow).

Loopback only; every wait is bounded (--timeout-s for the whole served phase).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench_utils import environment_header, print_table, report_on_sigterm, write_json

POLL_S = 0.25
PROMPTS = (
    "a red circle moves left on a black background",
    "a blue square moves right on a white background",
    "a green triangle moves up on a gray background",
    "a yellow circle moves down on a black background",
)
SERVE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def job_bodies(count: int, steps: int, size: str = "48x48", frames: int = 9) -> list[dict]:
    return [
        {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "size": size,
            "num_frames": frames,
            "num_inference_steps": steps,
            "seed": i % 8,
        }
        for i in range(count)
    ]


def warmup_bodies(count: int, steps: int, size: str, frames: int) -> list[dict]:
    """Untimed jobs of the same shape (other seeds), run first in both phases."""
    return [{**body, "seed": 1000 + i} for i, body in enumerate(job_bodies(count, steps, size, frames))]


def run_direct(
    bodies: list[dict],
    out: Path,
    *,
    model: Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
    warmup: list[dict] = (),
) -> tuple[float, dict[int, str], dict]:
    """Seconds for every job through one loaded pipeline, each job's frames_sha256, and what else was
    measured (load seconds, per-job pipeline and export seconds)."""
    import torch

    from mmgen.families import load_pipeline

    if device == "cpu" and model is None:  # the default model's run, as it always ran (the server: all cores)
        torch.set_num_threads(1)
    tick = time.perf_counter()
    pipe = load_pipeline(model, task="t2v", device=device, dtype=dtype)
    info: dict = {"load_s": time.perf_counter() - tick, "pipeline_s": [], "export_s": []}

    def one(pipe: object, body: dict, path: Path) -> tuple:
        width, height = (int(side) for side in body["size"].split("x"))
        fields = {k: v for k, v in body.items() if k != "size"}
        result = pipe(progress=False, height=height, width=width, **fields)
        tick = time.perf_counter()
        result.save(path)
        return result, time.perf_counter() - tick

    tick = time.perf_counter()
    for index, body in enumerate(warmup):
        one(pipe, body, out / f"warmup-{index}.mp4")
    info["warmup_s"] = time.perf_counter() - tick
    shas = {}
    info["latents_sha256"] = {}
    start = time.perf_counter()
    for index, body in enumerate(bodies):
        result, export = one(pipe, body, out / f"direct-{index}.mp4")
        shas[index] = result.frames_sha256
        info["latents_sha256"][index] = result.latents_sha256
        info["pipeline_s"].append(result.timings["total"])
        info["export_s"].append(export)
    elapsed = time.perf_counter() - start
    del pipe
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the server loads its own copy next
    return elapsed, shas, info


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    """(status, decoded JSON) of one request; status 0: no answer (the server gone, a 60 s timeout)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {}
    except (urllib.error.URLError, OSError):
        return 0, {}


def health(url: str) -> str:
    """/health's status: "ok" once the model is loaded, "loading", or "worker down: WHY"; "" while
    nothing answers (a group's ranks still loading behind the bound socket)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=60) as response:
            return json.loads(response.read()).get("status", "")
    except urllib.error.HTTPError as err:
        return json.loads(err.read() or b"{}").get("status", "")
    except (urllib.error.URLError, OSError):
        return ""


def create_and_poll(url: str, body: dict, poll_s: float, stop_at: float, statuses: list, lock) -> dict | None:
    """Submit one job and poll it until it ends (None: refused, or still running at stop_at)."""
    status, job = http("POST", url + "/v1/videos", body)
    with lock:
        statuses.append(status)
    while status == 200 and time.monotonic() < stop_at:
        time.sleep(poll_s)
        status, job = http("GET", f"{url}/v1/videos/{job['id']}")
        with lock:
            statuses.append(status)
        if status == 200 and job["status"] in ("completed", "failed", "cancelled"):
            return job
    return None


def serve_command(
    state: Path,
    *,
    model: Path | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    max_queue: int = 256,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """`mmgen serve` on 127.0.0.1 and a free port (`extra`: e.g. --gpus 2, --ray ADDRESS)."""
    command = [sys.executable, "-m", "mmgen.cli", "serve", "--port", "0", "--state", str(state)]
    command += ["--device", device, "--max-queue", str(max_queue), *extra]
    if model is not None:
        command += ["--model", str(model)]
    if dtype is not None:
        command += ["--dtype", SERVE_DTYPES[dtype]]
    return command


@contextlib.contextmanager
def running_server(command: list[str], logs: Path, ready_timeout_s: float = 300) -> Iterator[tuple]:
    """Start `command` (its stdout and stderr in logs/server.stdout, logs/server.log), wait until its
    /health is "ok" (at most ready_timeout_s), yield (process, url, seconds until ready); the server
    is always stopped on the way out (SIGTERM, SIGKILL after 20 s), also on KeyboardInterrupt."""
    stdout, log = logs / "server.stdout", logs / "server.log"
    started = time.perf_counter()
    with open(stdout, "w") as out, open(log, "w") as err:  # the child keeps its own copies
        proc = subprocess.Popen(command, stdout=out, stderr=err)
    try:
        deadline = time.monotonic() + ready_timeout_s
        url = ""
        while not url or health(url) != "ok":
            down = url and health(url).startswith("worker down")  # the model failed to load
            if down or proc.poll() is not None or time.monotonic() >= deadline:
                why = health(url) if url and proc.poll() is None else f"exit {proc.poll()}"
                raise SystemExit(f"server did not start ({why}); its stderr ends:\n{log.read_text()[-3000:]}")
            lines = [line for line in stdout.read_text().splitlines() if "listening on " in line]
            url = lines[0].split("listening on ", 1)[1].strip() if lines else ""
            time.sleep(0.2)
        yield proc, url, time.perf_counter() - started
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


@dataclass
class ClientRun:
    """What the clients saw: each job as it ended (by index), the seconds from its POST to the poll that
    saw it end (end-to-end latency, up to one poll late), every HTTP status, the wall seconds."""

    finished: dict[int, dict] = field(default_factory=dict)
    latency_s: dict[int, float] = field(default_factory=dict)
    statuses: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def run_clients(url: str, bodies: list[dict], clients: int, poll_s: float, timeout_s: float) -> ClientRun:
    """CLIENTS threads share the jobs, each like the openai client's create_and_poll: submit one, poll it
    until it ends, submit the next; every poll stops timeout_s after the start."""
    run, lock = ClientRun(), threading.Lock()
    stop_at = time.monotonic() + timeout_s

    def client(indices: list[int]) -> None:
        for index in indices:
            tick = time.monotonic()
            job = create_and_poll(url, bodies[index], poll_s, stop_at, run.statuses, lock)
            if job is not None:
                with lock:
                    run.finished[index] = job
                    run.latency_s[index] = time.monotonic() - tick

    start = time.perf_counter()
    threads = [
        threading.Thread(target=client, args=(list(range(i, len(bodies), clients)),), daemon=True)
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    run.wall_s = time.perf_counter() - start
    return run


def warm_up(url: str, bodies: list[dict], clients: int, poll_s: float, timeout_s: float) -> ClientRun:
    """Untimed jobs before the measured ones, `clients` at once (one per replica, so each warms up);
    every one must complete."""
    run = run_clients(url, bodies, clients, poll_s, timeout_s)
    for index in range(len(bodies)):
        job = run.finished.get(index)
        assert job is not None and job["status"] == "completed", f"warmup job {index} did not complete: {job}"
    return run


def run_served(
    bodies: list[dict],
    clients: int,
    state: Path,
    timeout_s: float,
    poll_s: float,
    *,
    model: Path | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    warmup: list[dict] = (),
) -> dict:
    max_queue = len(bodies) + len(warmup) + 1
    command = serve_command(state, model=model, device=device, dtype=dtype, max_queue=max_queue)
    with running_server(command, state.parent) as (proc, url, ready_s):
        warm = warm_up(url, list(warmup), 1, poll_s, timeout_s)  # one after another: as the direct phase
        rss_before = rss_kib(proc.pid)
        run = run_clients(url, bodies, clients, poll_s, timeout_s)
        return {"wall_s": run.wall_s, "statuses": warm.statuses + run.statuses, "finished": run.finished,
                "rss_before_kib": rss_before, "rss_after_kib": rss_kib(proc.pid), "ready_s": ready_s,
                "warmup_s": warm.wall_s}  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--size", default="48x48", help="WxH of every job (default 48x48)")
    parser.add_argument("--frames", type=int, default=9, help="frames of every job (4k + 1)")
    parser.add_argument(
        "--model", type=Path, default=None, help="model directory (default: the embedded one)"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both phases)")
    parser.add_argument("--dtype", choices=sorted(SERVE_DTYPES), default=None,
                        help="weights' dtype (default: float32 on the CPU, bfloat16 on CUDA)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=0, help="untimed jobs first in each phase")
    parser.add_argument("--make-random-wan13b", type=Path, default=None, metavar="DIR",
                        help="first write a random-weight Wan2.1-T2V-1.3B directory to DIR (then --model DIR)")  # fmt: skip
    parser.add_argument("--text-encoder", choices=("full", "reduced"), default="full",
                        help="with --make-random-wan13b: UMT5-XXL (full) or a labelled 2-layer one")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="with --make-random-wan13b: a tiny model instead")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--poll-s", type=float, default=POLL_S, help="each client's poll interval")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.make_random_wan13b is not None and args.model is None:
        args.model = args.make_random_wan13b
    if args.dtype is None:
        args.dtype = "float32" if args.device == "cpu" else "bfloat16"
    return args


def main() -> None:
    args = parse_args()
    report_on_sigterm()  # `timeout` in gpu_session.sh: the finally blocks still stop the server
    import torch

    print(environment_header(torch.device(args.device)), flush=True)
    made = None
    if args.make_random_wan13b is not None:
        from wan_models import write_random_wan_dir

        made = write_random_wan_dir(
            args.make_random_wan13b, tiny=args.tiny, text_encoder=args.text_encoder, device=args.device
        )
        gib = sum(made["bytes"].values()) / 2**30
        print(f"wrote {made['dit']} with random weights to {made['directory']} in {made['seconds']:.1f} s "
              f"({gib:.1f} GiB); text encoder: {made['text_encoder']}", flush=True)  # fmt: skip
    model_name = "the embedded default model" if args.model is None else str(args.model)
    print(f"jobs: {args.jobs} x {args.size} x {args.frames} frames x {args.steps} steps, {args.clients} clients, "
          f"{args.warmup} warmup job(s) per phase; model {model_name}, {args.device} {args.dtype}", flush=True)  # fmt: skip
    bodies = job_bodies(args.jobs, args.steps, args.size, args.frames)
    warmup = warmup_bodies(args.warmup, args.steps, args.size, args.frames)
    with tempfile.TemporaryDirectory(prefix="mmgen-serve-load-") as tmp:
        direct_s, direct_shas, direct = run_direct(
            bodies, Path(tmp), model=args.model, device=args.device, dtype=args.dtype, warmup=warmup
        )
        print(f"direct: load {direct['load_s']:.1f} s, warmup {direct['warmup_s']:.1f} s, "
              f"{args.jobs} jobs {direct_s:.1f} s", flush=True)  # fmt: skip
        served = run_served(bodies, args.clients, Path(tmp) / "state", args.timeout_s, args.poll_s,
                            model=args.model, device=args.device, dtype=args.dtype, warmup=warmup)  # fmt: skip
    finished = served["finished"]
    completed = {i: job for i, job in finished.items() if job["status"] == "completed"}
    mismatched = [i for i, job in completed.items() if job["frames_sha256"] != direct_shas[i]]
    waits = [job["timings"]["queue_wait"] for job in completed.values()]
    overhead_ms = [
        1000 * (job["timings"]["job"] - job["timings"]["total"] - job["timings"]["export"])
        for job in completed.values()
    ]
    row = [
        f"{args.jobs} x {args.steps} steps",
        args.clients,
        args.jobs - len(completed),
        sum(1 for status in served["statuses"] if status >= 500),
        len(mismatched),
        f"{percentile(waits, 0.5):.1f}",
        f"{percentile(waits, 0.99):.1f}",
        f"{statistics.median(overhead_ms) if overhead_ms else float('nan'):.1f}",
        f"{direct_s / served['wall_s']:.3f}",
        f"{served['rss_before_kib'] / 1024:.0f} -> {served['rss_after_kib'] / 1024:.0f}",
    ]
    print_table(
        [("jobs", 16), ("clients", 8), ("lost", 5), ("5xx", 4), ("sha!=", 6), ("wait p50 s", 11),
         ("wait p99 s", 11), ("overhead ms", 12), ("served/direct", 14), ("server RSS MiB", 16)],
        [row],
    )  # fmt: skip
    print(f"direct {direct_s:.1f} s, served {served['wall_s']:.1f} s (wall, {args.jobs} jobs)")
    if args.model is not None or args.warmup:
        served_pipeline = [job["timings"]["total"] for job in completed.values()]
        served_export = [job["timings"]["export"] for job in completed.values()]
        print(
            f"per job (median): direct pipeline {statistics.median(direct['pipeline_s']):.3f} s + export "
            f"{statistics.median(direct['export_s']):.3f} s; served pipeline "
            f"{statistics.median(served_pipeline) if served_pipeline else float('nan'):.3f} s + export "
            f"{statistics.median(served_export) if served_export else float('nan'):.3f} s + server "
            f"{statistics.median(overhead_ms) if overhead_ms else float('nan'):.1f} ms "
            f"(max {max(overhead_ms) if overhead_ms else float('nan'):.1f} ms)"
        )
        print(f"server: ready (model loaded) {served['ready_s']:.1f} s after start, warmup {served['warmup_s']:.1f} s; "
              f"direct load {direct['load_s']:.1f} s")  # fmt: skip
    if args.model is not None:
        latents = direct["latents_sha256"]
        latent_mismatches = sum(job["latents_sha256"] != latents[i] for i, job in completed.items())
        # Random VAE weights may decode NaN (uint8 0): equal frames then say little, equal latents do.
        print(f"latents_sha256 mismatches: {latent_mismatches} of {len(completed)}; distinct direct frames "
              f"{len(set(direct_shas.values()))}, latents {len(set(latents.values()))} over "
              f"{len({b['seed'] for b in bodies})} seeds")  # fmt: skip
    if made is not None:
        print(f"model: {made['dit']}, random weights; text encoder: {made['text_encoder']}")
    write_json(
        args.json,
        {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "direct_s": direct_s,
         "direct": direct, "served": served, "mismatched": mismatched, "model_written": made},
    )  # fmt: skip


if __name__ == "__main__":
    main()
