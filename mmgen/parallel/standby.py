"""Rank processes started before their work is known, so that their start-up overlaps the launcher's.

`mmgen generate --gpus N` knows it needs N ranks as soon as it reads `--gpus`, but its own parse and
request checks import torch and the request (seconds on a GPU host) before it can say what to run.
Spawned only then, each rank would pay the same imports again, one after the other. `StartedRanks`
spawns the N processes first: each imports its `preload` modules (torch and what its work needs)
and, on a GPU, makes its device's context, while the launcher parses; then it waits for its
assignment. `run_parallel(..., started=ranks)` hands rank r its world and function through a pipe
instead of spawning. Only small values cross (the function by reference, the flags, the request):
never a model or a tensor. Ranks the launcher did not use (a refused request) are stopped on close.

This module imports nothing heavy: a started rank sets its die-with-parent signal before its imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any


def torchrun_environment() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the launcher dies (a killed run leaves no orphans)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class StartedRanks:
    """`count` spawned processes waiting for their assignment; position p becomes the rank on GPU p.

    Use as a context manager (or call close()): leaving it stops every process still running."""

    def __init__(self, count: int, preload: Sequence[str] = (), device: str = "cpu"):
        """device: the `--device` the run was asked for (cpu, cuda or auto): on a GPU each process
        also sets its device and makes its context while it waits."""
        self.context = multiprocessing.get_context("spawn")
        self.results = self.context.Queue()  # what the ranks report (launch._worker's messages)
        self.processes: list[Any] = []
        self._inboxes: list[Any] = []
        for position in range(count):
            inbox, outbox = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=wait_for_work,
                args=(position, inbox, self.results, tuple(preload), device),
                name=f"mmgen-rank{position}",
            )
            process.start()
            inbox.close()  # the rank's end: it alone holds it now, so a closed outbox is its EOF
            self.processes.append(process)
            self._inboxes.append(outbox)

    @property
    def count(self) -> int:
        return len(self.processes)

    def assign(self, position: int, target: Callable[..., Any], args: tuple) -> None:
        """Process `position` runs target(*args, results) (args must pickle: no queues, no tensors)."""
        outbox = self._inboxes[position]
        outbox.send((target, args))
        outbox.close()

    def close(self) -> None:
        """Stop every process still running (an unassigned one may still be importing: no grace)."""
        for outbox in self._inboxes:
            outbox.close()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join()
        self.results.close()
        self.results.cancel_join_thread()  # nothing this process put: no feeder to wait for

    def __enter__(self) -> StartedRanks:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def wait_for_work(position: int, inbox: Any, results: Any, preload: tuple[str, ...], device: str) -> None:
    """A started process: import, warm the device, then run the assignment (or end on EOF)."""
    die_with_parent()
    try:
        for name in preload:
            importlib.import_module(name)
        if device != "cpu":
            warm_device(position)
        target, args = inbox.recv()
    except (EOFError, KeyboardInterrupt):
        return  # the launcher went on without this process (a refused request) or was interrupted
    target(*args, results)


def warm_device(position: int) -> None:
    """Make GPU `position`'s context now, while the launcher still parses (the rank's device: a
    world's rank r runs on GPU first_device + r, its position among the started processes).
    Best effort: a failure here is the rank's own set-up's to report, once it is assigned."""
    import torch

    with contextlib.suppress(Exception):
        if torch.cuda.is_available() and position < torch.cuda.device_count():
            torch.cuda.set_device(position)
            torch.zeros(1, device=torch.device("cuda", position))
