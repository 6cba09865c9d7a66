"""`mmgen serve --gpus 2 --cfg-parallel` on the CPU: 2 gloo ranks on the default model, rank 0 serving.

A served job's frames_sha256 equals what `mmgen generate --gpus 2 --cfg-parallel` prints for the same
request (CFG parallel is exact against sequential CFG, not against one process's batched CFG:
benchmarks/RESULTS.md 8a, so the reference is the parallel generate itself). A running job cancelled
through DELETE stops every rank at the same step: the job after it runs on the same group and still
matches. Stopping the server leaves no rank behind. The group protocol alone
(mmgen.executors.group_link, a stand-in pipeline with one collective per step): rank 0's cancel at step 3 stops every rank after
step 3, and the next job runs whole on every rank (a rank that ran on would time out the collectives).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from serve_cases import FAST, PROMPT, ServerProcess

pytest.importorskip("fastapi")

REAP_TIMEOUT_S = 15


def test_two_rank_server_matches_parallel_generate_and_cancels_on_every_rank(
    tmp_path: Path, default_model_dir: Path
) -> None:
    state = tmp_path / "state"
    ranks: list[int] = []
    try:
        with ServerProcess(state, default_model_dir, "--gpus", "2", "--cfg-parallel") as server:
            ranks = descendants(server.proc.pid)
            assert len(ranks) >= 2, ranks  # the two ranks (and multiprocessing's resource tracker)
            slow = {"prompt": PROMPT, **FAST, "num_inference_steps": 200, "seed": 5}
            fast = {"prompt": PROMPT, **FAST, "seed": 7}
            status, slow_job = server.request("POST", "/v1/videos", slow)
            assert status == 200, slow_job
            status, fast_job = server.request("POST", "/v1/videos", fast)
            assert status == 200, fast_job
            deadline = time.monotonic() + 60
            while server.request("GET", f"/v1/videos/{slow_job['id']}")[1]["progress"] < 1:
                assert time.monotonic() < deadline, "the slow job never made a step"
                time.sleep(0.01)
            status, _ = server.request("DELETE", f"/v1/videos/{slow_job['id']}")
            assert status == 200
            cancelled = server.wait_for(slow_job["id"], ("completed", "failed", "cancelled"))
            assert cancelled["status"] == "cancelled" and cancelled["progress"] < 90, cancelled
            done = server.wait_for(fast_job["id"], ("completed", "failed", "cancelled"))
            assert done["status"] == "completed", done
            outputs = sorted(p.name for p in (state / "outputs").iterdir())
            assert outputs == [f"{fast_job['id']}.mp4"], outputs  # the cancelled job published nothing
        assert done["frames_sha256"] == parallel_generate_sha256(default_model_dir, tmp_path, seed=7)
        assert done["request"]["parallel"] == "sp1(ulysses1 x ring1) x cfg2", done["request"]
        wait_reaped(ranks)
    finally:
        for pid in ranks:  # only if the test failed before its ranks were gone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


class StepPipe:
    """A stand-in pipeline for the group protocol: one collective per step (as a sharded model call
    makes), a progress report after each; records how many steps each call ran on this rank."""

    def __init__(self, layout) -> None:
        self.layout = layout
        self.steps: list[int] = []

    def generate(self, steps: int, *, progress) -> None:
        """`steps` stands for the request (whatever rank 0 hands out, every rank gets)."""
        import torch
        import torch.distributed as dist

        self.steps.append(0)
        progress.stage("denoise", steps)
        for _ in range(steps):
            dist.all_reduce(torch.ones(1), group=self.layout.world_group)
            self.steps[-1] += 1
            progress.advance()


class CancelAfter:
    """Rank 0's job reporter that finds its job cancelled at the `n`-th step (as JobProgress would)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def stage(self, name: str, total: int) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        from mmgen.executors.jobs import JobStopped

        self.seen += 1
        if self.seen == self.n:
            raise JobStopped("job")

    def close(self) -> None:
        pass


def group_protocol_on_rank(layout) -> list[list[int]]:
    """Rank 0 hands out a 10-step job cancelled at step 3, then a 4-step job; the others follow."""
    import torch.distributed as dist

    from mmgen.executors.group_link import GroupLink, GroupProgress, follow
    from mmgen.executors.jobs import JobStopped

    pipe = StepPipe(layout)
    if layout.owns_outputs:
        link = GroupLink(layout)
        link.idle()  # under HEARTBEAT_S since start: sends nothing
        link.job(10)
        with contextlib.suppress(JobStopped):
            pipe.generate(10, progress=GroupProgress(CancelAfter(3), link))
        link.job(4)
        pipe.generate(4, progress=GroupProgress(CancelAfter(0), link))
        link.stop()
    else:
        follow(pipe, layout)
    ranks: list = [None] * layout.world_size
    dist.all_gather_object(ranks, pipe.steps, group=layout.world_group)
    return ranks


def test_every_rank_leaves_a_cancelled_job_at_the_same_step() -> None:
    from mmgen.parallel.launch import run_parallel
    from mmgen.parallel.layout import ParallelConfig

    steps = run_parallel(group_protocol_on_rank, ParallelConfig(cfg=True), start_method="fork", timeout_s=15)
    assert steps == [[3, 4], [3, 4]]  # rank 0 and rank 1: 3 steps of the cancelled job, then all 4


def parallel_generate_sha256(model: Path, tmp_path: Path, seed: int) -> str:
    """frames_sha256 of `mmgen generate --gpus 2 --cfg-parallel` for PROMPT and FAST (forked gloo ranks)."""
    from mmgen.cli import GenerateRun, build_parser, generate_on_rank, generate_request, parallel_config
    from mmgen.parallel.launch import run_parallel

    args = build_parser().parse_args(
        [
            "generate", PROMPT, "--model", str(model), "--device", "cpu", "--height", "48", "--width", "48",
            "--frames", "9", "--steps", "2", "--seed", str(seed), "--gpus", "2", "--cfg-parallel",
            "--no-progress", "--out", str(tmp_path / "generated.mp4"),
        ]
    )  # fmt: skip
    run = GenerateRun(generate_request(args), tmp_path / "generated.mp4", False, "cpu", "auto")
    lines = run_parallel(generate_on_rank, parallel_config(args), args, run, start_method="fork")
    fields = dict(line.split(": ", 1) for line in lines)
    assert fields["parallel"] == "sp1(ulysses1 x ring1) x cfg2", fields
    return fields["frames_sha256"]


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (Linux /proc), children first."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


def wait_reaped(pids: list[int]) -> None:
    """Bounded: each of `pids` has exited (gone, or a zombie its new parent has yet to reap)."""
    deadline = time.monotonic() + REAP_TIMEOUT_S
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive:
            return
        assert time.monotonic() < deadline, f"ranks still running after the server stopped: {alive}"
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_group_settings_that_cannot_run_fail_before_any_rank_starts(
    tmp_path: Path,
    default_model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json

    from mmgen.cli import main
    from mmgen.parallel import launch

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_parallel was called: the check came after the ranks started")

    monkeypatch.setattr(launch, "run_parallel", no_spawn)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["serve", "--state", str(tmp_path / "state"), "--model", str(default_model_dir), "--device", "cpu"]
    assert main([*base, "--gpus", "3", "--sp", "2"]) == 2
    assert "--gpus 3 does not match --sp 2 = 2 processes" in capsys.readouterr().err
    # Ulysses 2H cannot split the model's H heads (read from its config.json, before anything loads)
    heads = json.loads((default_model_dir / "transformer" / "config.json").read_text())["num_attention_heads"]
    assert main([*base, "--gpus", str(2 * heads)]) == 2
    assert f"{heads} attention heads do not split over Ulysses degree {2 * heads}" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()  # nothing started, nothing written
