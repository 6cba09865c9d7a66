"""A leading launcher (mmgen.parallel.lead): `mmgen generate --gpus N`'s own process is rank 0 and N - 1
started processes are the others. Each case runs tests/leading_launcher.py in a process of its own
(2 gloo ranks on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mmgen.parallel.rank_watch import STOP_GRACE_S

HERE = Path(__file__).parent


def lead(case: str, device_type: str = "cpu", errors: list[str] | None = None) -> tuple[int, str, float]:
    """Exit code, output and seconds of `leading_launcher.py CASE DEVICE_TYPE` (its stderr's end too when it
    ended neither with a result nor through end_stuck); errors, given, gets its whole stderr."""
    path = os.pathsep.join(filter(None, (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH"))))
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(HERE / "leading_launcher.py"), case, device_type],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": path},
        timeout=120,
    )
    out = done.stdout.strip()
    if errors is not None:
        errors.append(done.stderr)
    if done.returncode not in (0, 3):
        out += "\n" + done.stderr[-2000:]
    return done.returncode, out, time.monotonic() - began


def test_the_launcher_is_rank_0_and_the_started_process_rank_1():
    code, out, _ = lead("pids")
    assert code == 0, out
    found = json.loads(out)
    assert found["value"] == [found["me"], *found["others"]]  # rank 0 is this process, rank 1 the started one


def test_a_rank_that_reported_ends_after_the_command_not_before_it():
    """Its teardown beside the command's slowed the command's own exit (RESULTS.md 28): it waits for the
    command's end (its die-with-parent signal), and has let go of the command's pipes (this run's output
    ended with the command)."""
    code, out, _ = lead("ends first")
    assert code == 0, out
    found = json.loads(out)
    assert found["alive"] == [True]
    deadline = time.monotonic() + 10
    while _running(found["others"][0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(found["others"][0])


def _running(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (a container's init may not reap an orphan)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_rank_0_settles_its_layout_while_the_world_joins():
    code, out, _ = lead("settles")
    assert code == 0, out
    assert json.loads(out)["value"] == ["PendingLayout", 2, [0, 1]]


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("rank 1 raises", "failed: rank 1 failed: ValueError: planted failure on rank 1"),
        ("rank 1 is killed", "failed: rank 1 was killed (signal 9)"),
        ("rank 0 raises", "failed: rank 0 failed: ValueError: planted failure on rank 0"),
        ("rank 1 hangs", "failed: rank 1 stopped answering (no heartbeat for 5 s: hung or stopped)"),
        ("rank 1 is interrupted", "interrupted"),  # Ctrl-C reaches every rank: the command's interrupt
        # `kill PID` (a container's stop): the others stopped before rank 0 unwinds through a collective
        ("the launcher alone gets SIGTERM", "terminated"),
    ],
)
def test_a_failing_rank_is_one_line_naming_it(case, line):
    """Whichever rank fails, the run ends soon (the other rank is waiting for it in a collective) with
    one RankFailed naming the rank that failed first, not the one whose collective broke after it."""
    code, out, seconds = lead(case)
    assert code == 0 and out.startswith(line) and "\n" not in out, out
    assert seconds < 60  # not the collective's 300 s timeout


def test_rank_0_stuck_with_a_failed_rank_ends_the_process_with_its_line():
    """Rank 0 that cannot return (NCCL waits for a failed peer until its timeout) is ended by end_stuck
    with the other rank's failure, STOP_GRACE_S after it was seen."""
    errors: list[str] = []
    code, out, seconds = lead("rank 0 is stuck", errors=errors)
    assert code == 3, out
    assert out == "stuck: rank 1 failed: ValueError: planted failure on rank 1"
    assert STOP_GRACE_S <= seconds < 60
    # nothing else said: the ranks' queue freed before the process ended (its semaphores were reported
    # as "leaked" by multiprocessing's resource tracker, seen on the GPU host's interrupted runs)
    assert "leaked" not in errors[0], errors[0][-2000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_on_two_gpus_a_failed_rank_never_leaves_rank_0_waiting_for_nccls_timeout():
    """Under NCCL, rank 0 waiting in a collective with a failed rank does not return: the run still
    ends within seconds with that rank's line (RankFailed if NCCL raised, else end_stuck's)."""
    code, out, _ = lead("pids", "cuda")
    assert code == 0, out
    found = json.loads(out)
    assert found["value"] == [found["me"], *found["others"]]
    for case, line in (
        ("rank 1 raises", "rank 1 failed: ValueError"),
        ("rank 1 is killed", "rank 1 was killed"),
    ):
        code, out, seconds = lead(case, "cuda")
        assert (code, out.split(": ", 1)[0]) in ((0, "failed"), (3, "stuck")), out
        assert out.split(": ", 1)[1].startswith(line) and seconds < 60, out
