"""A rank's output streams once it has reported: released, so a pipe reader of the command sees their end
when the command ends, not when each rank's teardown (its GPU context, NCCL's) is over."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A one-rank world's run_rank in a process whose stdout and stderr are pipes: what it prints before its
# report reaches the reader; after it, nothing does (a rank's late lines, e.g. a teardown's warnings).
RANK = """
import sys
from mmgen.parallel.launch import World, run_rank
from mmgen.parallel.layout import ParallelConfig

class Results(list):
    put = list.append

print("before", flush=True)
print("before-err", file=sys.stderr, flush=True)
results = Results()
try:
    run_rank(World(0, ParallelConfig(), "cpu", "tcp://127.0.0.1:1", 30.0, 0), 0, lambda layout: 7, (), results)
except SystemExit:  # a failure, reported
    pass
print("after", flush=True)
print("after-err", file=sys.stderr, flush=True)
print(*[kind for kind, *_ in results if kind != "alive"], file=sys.__stderr__, flush=True)
"""


def test_a_rank_that_reported_prints_nothing_more_to_the_commands_streams():
    done = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "before\n"
    assert done.stderr.strip().splitlines() == ["before-err"]  # not even the report kinds' line


def test_a_failing_rank_keeps_its_streams():
    """Only a reported result releases them: after a failure's report the rank's lines still print."""
    failing = RANK.replace("lambda layout: 7", "lambda layout: 1 / 0")
    done = subprocess.run(
        [sys.executable, "-c", failing], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "before\nafter\n"
    assert done.stderr.strip().splitlines() == ["before-err", "after-err", "error"]
