"""Does `mmgen serve` lose, corrupt or slow jobs under concurrent load? (issue 27's load test)

Runs the same jobs twice on the default model, on this machine:
1. direct: one process loads the pipeline and calls it job after job (`pipe(**fields)` + save);
2. served: `mmgen serve` in a subprocess on 127.0.0.1 and a free port; CLIENTS threads share the
   jobs, each like the openai client's create_and_poll: submit one, poll it every --poll-s until it
   ends, submit the next (so up to CLIENTS jobs wait in the queue).
Prints one table: jobs lost, 5xx answers, frames_sha256 mismatches against the direct run, queue
wait p50/p99, the server's own per-job overhead (the worker's job time minus the pipeline and
export), served / direct throughput, and the server's RSS before and after.

    python3 benchmarks/serve_load.py [--jobs 200] [--clients 16] [--steps 2] [--json out.json]

Loopback only; every wait is bounded (--timeout-s for the whole served phase).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_utils import environment_header, print_table, write_json

POLL_S = 0.25
PROMPTS = (
    "a red circle moves left on a black background",
    "a blue square moves right on a white background",
    "a green triangle moves up on a gray background",
    "a yellow circle moves down on a black background",
)


def job_bodies(count: int, steps: int) -> list[dict]:
    return [
        {
            "prompt": PROMPTS[i % len(PROMPTS)],
            "size": "48x48",
            "num_frames": 9,
            "num_inference_steps": steps,
            "seed": i % 8,
        }
        for i in range(count)
    ]


def run_direct(bodies: list[dict], out: Path) -> tuple[float, dict[int, str]]:
    """Seconds for every job through one loaded pipeline, and each job's frames_sha256."""
    import torch

    from pipelines.loader import load_pipeline

    torch.set_num_threads(1)
    pipe = load_pipeline(None, task="t2v", device="cpu", dtype="float32")
    shas = {}
    start = time.perf_counter()
    for index, body in enumerate(bodies):
        width, height = (int(side) for side in body["size"].split("x"))
        fields = {k: v for k, v in body.items() if k != "size"}
        result = pipe(progress=False, height=height, width=width, **fields)
        result.save(out / f"direct-{index}.mp4")
        shas[index] = result.frames_sha256
    return time.perf_counter() - start, shas


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, {}


def run_served(bodies: list[dict], clients: int, state: Path, timeout_s: float, poll_s: float) -> dict:
    log = open(state.parent / "server.log", "w")
    stdout = state.parent / "server.stdout"
    command = [
        sys.executable,
        "-m",
        "mmgen.cli",
        "serve",
        "--port",
        "0",
        "--state",
        str(state),
        "--device",
        "cpu",
    ]
    command += ["--max-queue", str(len(bodies) + 1)]
    proc = subprocess.Popen(command, stdout=open(stdout, "w"), stderr=log)
    try:
        deadline = time.monotonic() + 300
        url = ""
        while not url or http("GET", url + "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            lines = [line for line in stdout.read_text().splitlines() if "listening on " in line]
            url = lines[0].split("listening on ", 1)[1] if lines else ""
            time.sleep(0.2)
        rss_before = rss_kib(proc.pid)
        statuses: list[int] = []
        finished: dict[int, dict] = {}
        lock = threading.Lock()
        stop_at = time.monotonic() + timeout_s

        def client(indices: list[int]) -> None:
            """Like the openai client's create_and_poll: submit one job, poll it until it ends, next."""
            for index in indices:
                status, job = http("POST", url + "/v1/videos", bodies[index])
                with lock:
                    statuses.append(status)
                while status == 200 and time.monotonic() < stop_at:
                    time.sleep(poll_s)
                    status, job = http("GET", f"{url}/v1/videos/{job['id']}")
                    with lock:
                        statuses.append(status)
                    if status == 200 and job["status"] in ("completed", "failed", "cancelled"):
                        with lock:
                            finished[index] = job
                        break

        start = time.perf_counter()
        threads = [
            threading.Thread(target=client, args=(list(range(i, len(bodies), clients)),))
            for i in range(clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - start
        return {"wall_s": wall, "statuses": statuses, "finished": finished, "rss_before_kib": rss_before,
                "rss_after_kib": rss_kib(proc.pid)}  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--poll-s", type=float, default=POLL_S, help="each client's poll interval")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    import torch

    print(environment_header(torch.device("cpu")))
    bodies = job_bodies(args.jobs, args.steps)
    with tempfile.TemporaryDirectory(prefix="mmgen-serve-load-") as tmp:
        direct_s, direct_shas = run_direct(bodies, Path(tmp))
        served = run_served(bodies, args.clients, Path(tmp) / "state", args.timeout_s, args.poll_s)
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
    write_json(
        args.json, {"args": vars(args), "direct_s": direct_s, "served": served, "mismatched": mismatched}
    )


if __name__ == "__main__":
    main()
