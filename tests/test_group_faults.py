"""A rank of a local group killed mid-job: the job ends with an error and the run raises one line
within seconds, instead of the other ranks waiting in a collective until its timeout (issue 38)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from mmgen.executors.groups import LocalGroupsExecutor
from mmgen.executors.in_process import JOB_START_HOOK_ENV
from mmgen.executors.jobs import JobSpec, ModelSpec
from mmgen.parallel.launch import RankFailed
from mmgen.parallel.layout import ParallelConfig
from pipelines.request import GenerationRequest


def rank_pids(parent: int | None = None) -> list[int]:
    """Pids of the spawned children of `parent` (default: this process) that run a rank (not
    multiprocessing's resource tracker); tests/test_serve_group_faults.py finds a server's ranks so."""
    parent_pid = os.getpid() if parent is None else parent
    ranks = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent_of = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent_of == parent_pid and b"spawn_main" in command and b"resource_tracker" not in command:
            ranks.append(int(entry.name))
    return sorted(ranks)


@pytest.mark.slow  # two spawned interpreters import torch and load the default model (~30 s on 2 cores)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_ends_the_job_with_one_line_within_seconds(tmp_path, mmgen_cache_dir, monkeypatch):
    hook = tmp_path / "job_starts.txt"
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    monkeypatch.setenv(JOB_START_HOOK_ENV, str(hook))
    # long enough that the kill lands inside the denoise loop (two ranks exchanging every step)
    request = GenerationRequest(
        prompt="a dog running", seed=2, height=96, width=96, num_frames=13, num_inference_steps=200
    )
    executor = LocalGroupsExecutor(ModelSpec("default", device="cpu", dtype="float32"), ParallelConfig(sp=2))
    outcome: dict = {"jobs": []}

    def render() -> None:
        try:
            outcome["jobs"].extend(executor.run([JobSpec(0, "long", request)]))
        except BaseException as err:  # noqa: BLE001 - read by the test below
            outcome["error"] = err

    thread = threading.Thread(target=render, daemon=True)
    thread.start()
    deadline = time.monotonic() + 240
    while not hook.exists():
        assert thread.is_alive(), f"the group ended before its job started: {outcome}"
        assert time.monotonic() < deadline, "the group never started its job"
        time.sleep(0.05)
    time.sleep(1.0)  # into the steps
    ranks = rank_pids()
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGKILL)  # the later-started process: rank 1, a following rank
    killed = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the run still waits 30 s after a rank was killed"
    assert time.monotonic() - killed < 10
    error = outcome.get("error")
    assert isinstance(error, RankFailed) and "\n" not in str(error), outcome
    # the killed rank is named as the cause (rank 0's own error, a closed connection, follows it)
    assert str(error).startswith(("rank 1 was killed (signal 9)", "rank 1 exited with code -9")), error
    assert all(not job.ok for job in outcome["jobs"])  # the job, if it came back, came back failed
    assert rank_pids() == []  # rank 0 stopped too


def _hang_rank_1(layout) -> None:
    """Rank 1 stops itself (SIGSTOP: no exit, no error) after its heartbeat began; rank 0 waits for it
    in a collective (under a collective timeout far past the launcher's liveness bound)."""
    import torch.distributed as dist

    if layout.rank == 1:
        time.sleep(1.0)  # its first heartbeats reach the launcher
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.barrier(group=layout.world_group)


def test_a_hung_rank_fails_the_run_by_its_missing_heartbeat() -> None:
    from mmgen.parallel.launch import run_parallel
    from mmgen.parallel.rank_watch import LIVENESS_S

    start = time.monotonic()
    with pytest.raises(RankFailed) as caught:
        run_parallel(_hang_rank_1, ParallelConfig(sp=2), start_method="fork", timeout_s=120)
    assert time.monotonic() - start < LIVENESS_S + 10  # not the collective's 120 s
    assert str(caught.value).startswith("rank 1 stopped answering (no heartbeat for"), caught.value
