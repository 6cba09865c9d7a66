"""Ray replicas past the happy path: LoRA-aware scheduling, replacing a lost replica, Ctrl-C.

The scheduler alone (no Ray): a job goes to a free replica already holding its LoRA set, else to
the free replica whose set is cheapest to give up. On a local 2-CPU Ray cluster on loopback: jobs
with two tiny LoRAs sent one at a time to 2 replicas each land on the replica holding their set,
so each replica loads its LoRA once (4 jobs, 2 loads; first-free would load 4 times); a replica
killed mid-job is replaced and the job runs again on the replacement with the one-process SHA,
recorded once; SIGINT to `mmgen render --ray` stops its replicas (their processes exit, no named
actor left) within bounded time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from lora_cases import save, wan_lora

from mmgen.executors.scheduling import BASE, AffinityScheduler, lora_set
from mmgen.render.manifest import MANIFEST_NAME
from pipelines.request import GenerationRequest

ray = pytest.importorskip("ray")
from ray_cases import local_ray_cluster  # noqa: E402 - needs ray

ROOT = Path(__file__).resolve().parents[1]
STOP_TIMEOUT_S = 30


def test_scheduler_prefers_the_replica_holding_the_jobs_set() -> None:
    scheduler = AffinityScheduler()
    key = str.upper  # job 'a' needs set 'A'
    assert scheduler.assign(["a", "b"], ["r0", "r1"], key) == [("r0", "a"), ("r1", "b")]
    assert scheduler.assign(["a"], ["r1", "r0"], key) == [("r0", "a")]  # r0 holds A
    assert scheduler.assign(["b", "a"], ["r1"], key) == [("r1", "b")]  # out of order: r1 holds B
    # No free replica holds the set: one on the base weights takes it (no loaded set given up).
    scheduler.forget("r2")
    assert scheduler.assign(["c"], ["r0", "r2"], key) == [("r2", "c")]
    assert scheduler.assign(["d", "a"], ["r0", "r2"], key) == [("r0", "a"), ("r2", "d")]
    assert scheduler.assign(["e", "d"], ["r0", "r2"], key) == [("r2", "d"), ("r0", "e")]
    assert scheduler.holds("r9") == BASE


def test_a_jobs_set_is_its_loras_and_placement(tmp_path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    a.write_bytes(b"a")
    b.write_bytes(b"b")

    def key(**fields: object):
        return lora_set(GenerationRequest.from_call(prompt="x", **fields))

    assert key() == key(seed=3, num_frames=5) == BASE  # the prompt and sizes are not held
    assert key(lora=f"{a}:0.5") == key(lora=f"{a}:0.5", seed=9) != key(lora=f"{a}:0.8")
    assert key(lora=f"{a}") != key(lora=f"{b}") != key(lora=[str(a), str(b)])
    assert key(lora=f"{a}@1") != key(lora=f"{a}")  # on Wan2.2's second expert only
    assert key(lora=f"{a}", lora_mode="unfused") != key(lora=f"{a}")
    assert key(offload="model") != BASE


@pytest.fixture(scope="module")
def cluster(mmgen_cache_dir: Path):
    """A local Ray cluster of 2 CPUs on loopback; its workers (also those of other drivers joining
    it) inherit this checkout's PYTHONPATH and the cache holding the default model."""
    with local_ray_cluster({"PYTHONPATH": str(ROOT), "MMGEN_CACHE_DIR": str(mmgen_cache_dir)}) as address:
        yield address


def plan_of(tmp_path: Path, text: str, **fields: object):
    from mmgen.render.schema import load_render_file

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "batch.yaml"
    path.write_text(textwrap.dedent(text).format(**fields))
    return load_render_file(path, output_dir=tmp_path / "out")


LORA_BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {{height: 16, width: 16, num_frames: 1, num_inference_steps: 1, guidance_scale: 1.0, max_sequence_length: 16}}
    jobs:
      - {{name: a1, prompt: a cat, seed: 1, loras: ["{a}"]}}
      - {{name: b1, prompt: a cat, seed: 2, loras: ["{b}"]}}
      - {{name: a2, prompt: a dog, seed: 3, loras: ["{a}"]}}
      - {{name: b2, prompt: a dog, seed: 4, loras: ["{b}"]}}
"""


def test_jobs_go_to_the_replica_holding_their_lora(cluster, default_model_dir, tmp_path) -> None:
    from mmgen.executors.ray_executor import RayExecutor, RayTimeouts
    from pipelines.wan_t2v import WanT2VPipeline

    transformer = WanT2VPipeline.from_pretrained(default_model_dir).transformer
    a = save(tmp_path / "a.safetensors", *wan_lora(transformer, seed=1, extras=False))
    b = save(tmp_path / "b.safetensors", *wan_lora(transformer, seed=2, extras=False))
    plan = plan_of(tmp_path, LORA_BATCH, a=a, b=b)
    where: dict[str, str] = {}
    loads: dict[str, int] = {}
    with RayExecutor(plan.model_spec(), replicas=2, timeouts=RayTimeouts(start=120, job=120)) as executor:
        for job in plan.jobs:  # one at a time: both replicas are free at every choice
            assert executor.capacity() == 2
            executor.submit(job)
            finished = []
            deadline = time.monotonic() + 60
            while not finished:
                assert time.monotonic() < deadline, f"job {job.label} did not finish"
                finished = executor.step(5.0)
            assert finished[0].ok, finished[0].error
            where[job.label], loads[job.label] = finished[0].replica, finished[0].lora_loads
        usage = executor.usage()
    assert where["a1"] == where["a2"] != where["b1"] == where["b2"], where
    assert loads == {"a1": 1, "b1": 1, "a2": 0, "b2": 0}, loads  # each replica read its LoRA once
    assert sorted(u["lora_loads"] for u in usage.values()) == [1, 1], usage
    assert sorted(u["jobs"] for u in usage.values()) == [2, 2], usage


SLOW_BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {{height: 48, width: 48, num_frames: 9, max_sequence_length: 16}}
    jobs:
      - {{name: slow, prompt: a dog running, seed: 2, num_inference_steps: 40}}
      - {{name: fast, prompt: a boat, seed: 3, num_inference_steps: 2}}
"""


def test_a_killed_replica_is_replaced_and_its_job_runs_again(
    cluster, mmgen_cache_dir, tmp_path, monkeypatch
) -> None:
    from mmgen.executors.ray_executor import RayExecutor, RayTimeouts
    from mmgen.render.runner import RenderSummary, run_render

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    reference = run_render(plan_of(tmp_path / "one", SLOW_BATCH), show_progress=False)
    executors: list[RayExecutor] = []
    said: list[str] = []
    done: list[RenderSummary] = []

    def executor(plan):
        timeouts = RayTimeouts(start=120, job=120)
        executors.append(
            RayExecutor(plan.model_spec(), replicas=1, restarts=1, timeouts=timeouts, log=said.append)
        )
        return executors[-1]

    plan = plan_of(tmp_path / "ray", SLOW_BATCH)
    thread = threading.Thread(target=lambda: done.append(run_render(plan, executor=executor)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 90
    while not (executors and executors[0].in_flight and running_index(executors[0]) == 0):
        assert thread.is_alive() and time.monotonic() < deadline, "the slow job never started"
        time.sleep(0.05)
    (victim,) = executors[0].where
    os.kill(executors[0].where[victim]["pid"], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the render did not finish after the kill"

    summary = done[0]
    assert not summary.failed, summary.format()
    records = [
        json.loads(line) for line in (tmp_path / "ray" / "out" / MANIFEST_NAME).read_text().splitlines()
    ]
    assert sorted(r["job"]["label"] for r in records) == ["fast", "slow"]  # each recorded once
    shas = {o.job.label: o.record["frames_sha256"] for o in reference.outcomes}
    assert {r["job"]["label"]: r["frames_sha256"] for r in records} == shas
    replacement = f"{victim}r1"
    assert {r["replica"] for r in records} == {replacement}  # both ran on the replacement
    assert f"{victim} lost; starting {replacement} in its place" in said
    assert [u.name for u in summary.replicas] == [replacement] and summary.replicas[0].jobs == 2
    assert f"replica {replacement}: 2 jobs, busy " in summary.format()
    busy = sum(r["timings"]["job"] - r["timings"]["export"] for r in records)  # from the manifest alone
    assert busy == pytest.approx(summary.replicas[0].busy_s)


def running_index(executor) -> int | None:
    (actor,) = executor.actors.values()
    return ray.get(actor.running.remote(), timeout=30)


def test_sigint_stops_the_replicas_of_render_ray(cluster, tmp_path) -> None:
    path = tmp_path / "batch.yaml"
    # a job that outlasts the test: the most steps a request takes (1000) on a larger video
    slow = "1000, height: 128, width: 128, num_frames: 17}"
    path.write_text(textwrap.dedent(SLOW_BATCH).format().replace("40}", slow))
    command = [
        sys.executable, "-m", "mmgen.cli", "render", str(path), "--out", str(tmp_path / "out"),
        "--no-progress", "--ray", cluster, "--replicas", "2",
    ]  # fmt: skip
    log = tmp_path / "render.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    pids: list[int] = []
    states: list[int | None] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 or not any(index is not None for index in states):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"no replica started a job: {log.read_text()[-3000:]}"
            actors = replica_actors()
            states = [ray.get(a.running.remote(), timeout=30) for a in actors]
            pids = [ray.get(a.where.remote(), timeout=30)["pid"] for a in actors]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=STOP_TIMEOUT_S) == 130, log.read_text()[-3000:]
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while any(process_running(pid) for pid in pids) or replica_actors():
            assert time.monotonic() < deadline, f"replicas still there: {pids}, {replica_actors()}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def replica_actors() -> list:
    """Every live named mmgen replica actor on the cluster, whichever driver started it."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith("mmgen-replica-"):
            with contextlib.suppress(ValueError):  # gone since the listing
                found.append(ray.get_actor(entry["name"], namespace=entry["namespace"]))
    return found


def process_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
