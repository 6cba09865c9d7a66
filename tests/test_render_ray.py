"""`mmgen render --ray`: jobs on Ray replicas (a local 2-CPU Ray cluster started here, on loopback)
give the one-process render's frames SHA per job, and the driver records each job once, even when a
replica is killed mid-job (its job runs again on the other replica). A job past its timeout fails with
a line naming the timeout and its replica is replaced (the next job runs on the replacement); a
2-rank CFG replica one of whose ranks is killed mid-job is replaced whole (a new placement group)
and its job runs again there with the local groups' SHA."""

from __future__ import annotations

import json
import os
import re
import signal
import textwrap
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import ray
from ray_cases import local_ray_cluster

from mmgen.errors import MmgenError
from mmgen.executors.ray_executor import RayExecutor, RayTimeouts
from mmgen.render import cli
from mmgen.render.manifest import MANIFEST_NAME
from mmgen.render.runner import JOB_START_HOOK_ENV, RenderSummary, run_render
from mmgen.render.schema import load_render_file

ROOT = Path(__file__).resolve().parents[1]
BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 48, width: 48, num_frames: 9, num_inference_steps: 2, max_sequence_length: 16}
    jobs:
      - {name: a, prompt: a cat, seed: 1}
      - {name: slow, prompt: a dog running, seed: 2, height: 96, width: 96, num_frames: 17, num_inference_steps: 16}
      - {name: c, prompt: a boat, seed: 3}
      - {name: d, prompt: a tree, seed: 4}
      - {name: e, prompt: a car, seed: 5}
      - {name: f, prompt: a bird, seed: 6}
"""
LABELS = ["a", "slow", "c", "d", "e", "f"]
TIMEOUTS = RayTimeouts(start=120.0, job=120.0)


@pytest.fixture(scope="module")
def batch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = tmp_path_factory.mktemp("ray-batch") / "batch.yaml"
    config.write_text(textwrap.dedent(BATCH))
    return config


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The replicas' job-start hook file: one '<index> <label>' line per job started."""
    return tmp_path_factory.mktemp("ray-hook") / "job_starts.txt"


@pytest.fixture(scope="module")
def cluster(mmgen_cache_dir: Path, hook: Path):
    """A local Ray cluster of 2 CPUs on loopback, its workers importing this checkout; shut down even on failure."""
    env = {"PYTHONPATH": str(ROOT), "MMGEN_CACHE_DIR": str(mmgen_cache_dir), JOB_START_HOOK_ENV: str(hook)}
    with local_ray_cluster(runtime_env={"env_vars": env}):
        yield


@pytest.fixture(scope="module")
def reference(batch: Path, tmp_path_factory: pytest.TempPathFactory, mmgen_cache_dir: Path) -> dict[str, str]:
    """frames_sha256 per job of the one-process render."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
        plan = load_render_file(batch, output_dir=tmp_path_factory.mktemp("one-process"))
        summary = run_render(plan, show_progress=False)
    assert not summary.failed
    return {o.job.label: o.record["frames_sha256"] for o in summary.outcomes}


def manifest_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / MANIFEST_NAME).read_text().splitlines()]


def test_two_replicas_give_the_one_process_shas_and_a_rerun_is_done(
    cluster, batch, reference, tmp_path, capsys
):
    out = tmp_path / "out"
    command = ["render", str(batch), "--out", str(out), "--no-progress", "--ray", "auto", "--replicas", "2"]
    assert cli.main(command) == 0  # Ray is initialized here already: --ray auto uses that cluster
    printed = capsys.readouterr()
    records = manifest_records(out)
    assert Counter(r["job"]["label"] for r in records) == Counter(LABELS)  # each job once
    assert {r["job"]["label"]: r["frames_sha256"] for r in records} == reference
    assert all((out / r["outputs"][0]["path"]).is_file() for r in records)
    assert len({r["replica"] for r in records}) == 2  # both replicas rendered
    busy = re.findall(r"mmgen-replica-\S+ on \S+: (\d+) jobs, busy [\d.]+s", printed.err)
    assert len(busy) == 2 and sum(map(int, busy)) == 6, printed.err
    assert "6 rendered, 0 already done, 0 failed" in printed.out

    assert cli.main(command) == 0
    assert "0 rendered, 6 already done, 0 failed" in capsys.readouterr().out  # no replica started
    assert len(manifest_records(out)) == 6


def test_a_node_without_the_model_directory_stops_before_the_first_job(cluster, batch, tmp_path):
    plan = replace(load_render_file(batch, output_dir=tmp_path / "out"), model=str(tmp_path / "nowhere"))
    executor = RayExecutor(plan.model_spec(), replicas=1, timeouts=TIMEOUTS)
    with pytest.raises(
        MmgenError, match=r"^node \S+ \(replica \S+\): model directory .*nowhere does not exist"
    ):
        executor.__enter__()
    assert not executor.actors  # the replica it started is stopped


def test_device_auto_on_a_cpu_only_cluster_renders_on_its_cpus(cluster, batch, reference, tmp_path, capsys):
    """A file without `device:` on this CPU-only cluster: the replica asks for no GPU (it used to
    wait for one until the start timeout) and renders the one-process frames."""
    config = tmp_path / "auto.yaml"
    lines = batch.read_text().splitlines(keepends=True)
    kept = "".join(line for line in lines if not line.startswith(("device:", "  - {name: ")))
    config.write_text(kept + "  - {name: a, prompt: a cat, seed: 1}\n")  # job a alone
    assert load_render_file(config).device == "auto"
    out = tmp_path / "out"
    start = time.monotonic()
    assert cli.main(["render", str(config), "--out", str(out), "--no-progress", "--ray", "auto"]) == 0
    assert time.monotonic() - start < TIMEOUTS.start
    (record,) = manifest_records(out)
    assert record["frames_sha256"] == reference["a"] and record["settings"]["device"] == "cpu"
    capsys.readouterr()


def test_more_replicas_than_the_cluster_holds_are_refused_before_placing(cluster, batch, tmp_path):
    plan = load_render_file(batch, output_dir=tmp_path / "out")
    executor = RayExecutor(plan.model_spec(), replicas=3, timeouts=TIMEOUTS)
    start = time.monotonic()
    with pytest.raises(MmgenError, match=r"^Ray cluster: room for 2 of 3 replicas: a replica needs 1 CPU"):
        executor.__enter__()
    assert time.monotonic() - start < 10 and not executor.actors  # nothing was placed


@pytest.mark.parametrize("kill", ["ray.kill", "os.kill"])
def test_a_replica_killed_mid_job_its_job_runs_again_and_is_recorded_once(
    cluster, batch, reference, hook, tmp_path, kill
):
    out = tmp_path / "out"
    executors: list[RayExecutor] = []
    done: list[RenderSummary] = []

    def executor(plan):
        executors.append(RayExecutor(plan.model_spec(), replicas=2, timeouts=TIMEOUTS))
        return executors[-1]

    def render():
        plan = load_render_file(batch, output_dir=out)
        done.append(run_render(plan, show_progress=False, executor=executor))

    starts_before = len(hook.read_text().splitlines()) if hook.exists() else 0
    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not (hook.exists() and "1 slow" in hook.read_text().splitlines()[starts_before:]):
        assert thread.is_alive(), "the render ended before the slow job started"
        assert time.monotonic() < deadline, "the slow job never started"
        time.sleep(0.02)
    running = {
        name: ray.get(actor.running.remote(), timeout=30) for name, actor in executors[0].actors.items()
    }
    victim = next(name for name, index in running.items() if index == 1)
    if kill == "ray.kill":
        ray.kill(executors[0].actors[victim])
    else:  # the replica's process dies under it (same machine here: the pid is local)
        os.kill(executors[0].where[victim]["pid"], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive(), "the render did not finish after the kill"

    assert not done[0].failed, done[0].format()
    records = manifest_records(out)
    assert Counter(r["job"]["label"] for r in records) == Counter(LABELS)  # recorded once
    assert {r["job"]["label"]: r["frames_sha256"] for r in records} == reference
    slow = next(r for r in records if r["job"]["label"] == "slow")
    assert slow["replica"] != victim  # it ran again on the other replica
    assert hook.read_text().splitlines()[starts_before:].count("1 slow") == 2


TIMEOUT_BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 16, width: 16, num_frames: 1, num_inference_steps: 1, max_sequence_length: 16}
    jobs:
      - {name: stuck, prompt: a dog running, seed: 2, height: 128, width: 128, num_frames: 17, num_inference_steps: 1000}
      - {name: next, prompt: a boat, seed: 3}
"""


def test_a_job_past_its_timeout_fails_and_its_replica_is_replaced(cluster, mmgen_cache_dir, tmp_path):
    config = tmp_path / "timeout.yaml"
    config.write_text(textwrap.dedent(TIMEOUT_BATCH))
    executors: list[RayExecutor] = []
    said: list[str] = []

    def executor(plan):
        timeouts = RayTimeouts(start=120.0, job=8.0)  # the tiny job takes well under a second
        executors.append(
            RayExecutor(plan.model_spec(), replicas=1, restarts=1, timeouts=timeouts, log=said.append)
        )
        return executors[-1]

    started = time.monotonic()
    plan = load_render_file(config, output_dir=tmp_path / "out")
    summary = run_render(plan, show_progress=False, executor=executor)
    assert time.monotonic() - started < 50  # 8 s, a replacement's load, a tiny job: no hang
    victim = next(iter(executors[0].where))  # the first replica (its replacement comes after)
    replacement = f"{victim}r1"
    errors = {o.job.label: o.error for o in summary.failed}
    expected = f"took over the 8s job timeout on replica {victim}; replica stopped and replaced"
    assert errors == {"stuck": expected}, summary.format()
    assert (
        f"{victim} stopped: its job took over the 8s job timeout; starting {replacement} in its place" in said
    )
    records = {r["job"]["label"]: r for r in manifest_records(tmp_path / "out")}
    assert [r["status"] for r in records.values()] == ["failed", "ok"], records  # each once
    assert records["next"]["replica"] == replacement  # the next job ran on the replacement


CFG_BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 32, width: 48, num_frames: 5, num_inference_steps: 2, guidance_scale: 5.0, max_sequence_length: 16}
    jobs:
      - {name: cat, prompt: a cat on a red sofa, seed: 1}
      - {name: boat, prompt: a boat, seed: 2}
"""


def test_a_two_rank_cfg_parallel_replica_gives_the_local_groups_shas(cluster, mmgen_cache_dir, tmp_path):
    from mmgen.parallel.layout import ParallelConfig
    from mmgen.render.groups import run_render_groups

    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(CFG_BATCH))
    cfg = ParallelConfig(cfg=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
        local = run_render_groups(load_render_file(config, output_dir=tmp_path / "local"), cfg, 1)
    assert not local.failed, local.format()

    def executor(plan):
        return RayExecutor(plan.model_spec(), replicas=1, parallel=cfg, timeouts=TIMEOUTS)

    summary = run_render(
        load_render_file(config, output_dir=tmp_path / "ray"), show_progress=False, executor=executor
    )
    assert not summary.failed, summary.format()
    shas = {o.job.label: o.record["frames_sha256"] for o in summary.outcomes}
    assert shas == {o.job.label: o.record["frames_sha256"] for o in local.outcomes}
    assert {o.record["args"]["parallel"] for o in summary.outcomes} == {"sp1(ulysses1 x ring1) x cfg2"}


CFG_SLOW_BATCH = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 32, width: 48, num_frames: 5, num_inference_steps: 2, guidance_scale: 5.0, max_sequence_length: 16}
    jobs:
      - {name: slow, prompt: a dog running, seed: 2, num_inference_steps: 30}
      - {name: boat, prompt: a boat, seed: 3}
"""


def test_a_lost_rank_of_a_cfg_replica_replaces_the_whole_group(cluster, mmgen_cache_dir, tmp_path):
    from mmgen.parallel.layout import ParallelConfig
    from mmgen.render.groups import run_render_groups

    config = tmp_path / "cfg.yaml"
    config.write_text(textwrap.dedent(CFG_SLOW_BATCH))
    cfg = ParallelConfig(cfg=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
        local = run_render_groups(load_render_file(config, output_dir=tmp_path / "local"), cfg, 1)
    assert not local.failed, local.format()
    executors: list[RayExecutor] = []
    said: list[str] = []
    done: list[RenderSummary] = []

    def executor(plan):
        executors.append(
            RayExecutor(plan.model_spec(), replicas=1, parallel=cfg, timeouts=TIMEOUTS, log=said.append)
        )
        return executors[-1]

    plan = load_render_file(config, output_dir=tmp_path / "ray")

    def render():
        done.append(run_render(plan, show_progress=False, executor=executor))

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not (executors and executors[0].in_flight and denoise_steps_done(executors[0]) >= 1):
        assert thread.is_alive() and time.monotonic() < deadline, "the slow job never reached a step"
        time.sleep(0.05)
    (victim,) = executors[0].followers
    (rank1,) = executors[0].followers[victim]
    group = executors[0].groups[victim]
    os.kill(ray.get(rank1.where.remote(), timeout=30)["pid"], signal.SIGKILL)  # rank 1 only
    thread.join(timeout=90)
    assert not thread.is_alive(), "the render did not finish after the kill"

    assert not done[0].failed, done[0].format()
    records = manifest_records(tmp_path / "ray")
    assert sorted(r["job"]["label"] for r in records) == ["boat", "slow"]  # each recorded once
    assert {r["job"]["label"]: r["frames_sha256"] for r in records} == {
        o.job.label: o.record["frames_sha256"] for o in local.outcomes
    }
    replacement = f"{victim}r1"
    assert {r["replica"] for r in records} == {replacement}  # both ran on the new group
    assert f"{victim} lost; starting {replacement} in its place" in said
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"  # the old group is gone
    assert not executors[0].groups  # and the new one was removed at the end


def denoise_steps_done(executor: RayExecutor) -> int:
    """Denoising steps rank 0 of the (one) replica has done in its running job (0 outside denoise)."""
    (actor,) = executor.actors.values()
    _, stage, done, _ = ray.get(actor.progress.remote(), timeout=30)
    return done if stage == "denoise" else 0
