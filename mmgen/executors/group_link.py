"""How the ranks of one local group run each job together: rank 0 leads, every other rank follows.

Rank 0 (the process whose InProcessExecutor holds the link: a local group's rank 0,
mmgen.executors.groups; the process of `mmgen serve --gpus N` that serves HTTP; `mmgen generate
--gpus N`'s first rank) hands each job to the group; every other rank loads the same pipeline on its
layout and follows:

    rank 0                                         ranks 1..N-1
    a job -> broadcast ("job", request)        ->  pipe.generate(request, progress=FollowerProgress)
    pipe.generate(request, GroupProgress(...))     the same call: same request, same plan
      each stage / step: broadcast stop flag   ->    each stage / step: receive it; JobStopped if set
    idle: ("idle", None) every HEARTBEAT_S     ->  wait for the next message
    shutdown: ("stop", None)                   ->  return

Stopping is per step: rank 0's own reporter decides (it raises JobStopped once its client stopped
the job) and GroupProgress broadcasts the decision at the same progress report every rank makes,
so every rank leaves the pipeline at the same step and the group is ready for the next job. The
idle heartbeat keeps a waiting rank's collective under the process group's timeout.

Failures: every rank checks the request the same way, so a refused request fails on every rank
before any collective and the group goes on. A failure on one rank only, inside the pipeline between
two progress reports (out of memory on one GPU), leaves the other ranks waiting in a collective until
its timeout (mmgen.parallel.launch.DEFAULT_TIMEOUT_S); the job fails, and the group may be out of
step after it: restart it (a server's queue re-runs what was interrupted).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from mmgen.executors.jobs import JobStopped
from mmgen.parallel.layout import ParallelLayout

HEARTBEAT_S = 30.0  # well under the collectives' timeout (mmgen.parallel.launch.DEFAULT_TIMEOUT_S)


class GroupLink:
    """Rank 0's end of the group: hands out jobs, keeps an idle group alive, stops it."""

    def __init__(self, layout: ParallelLayout) -> None:
        self.layout = layout
        self._sent_at = time.monotonic()
        self._stopped = False

    def job(self, request: Any) -> None:
        """Every rank runs `request` (the GenerationRequest rank 0 runs; pickled once, sent to all)."""
        self._send(("job", request))

    def idle(self) -> None:
        """No job: a heartbeat once every HEARTBEAT_S, so no rank waits past the collective timeout."""
        if time.monotonic() - self._sent_at >= HEARTBEAT_S:
            self._send(("idle", None))

    def stop(self) -> None:
        """The other ranks return from following; once (they are gone after the first: a second stop,
        e.g. a caller's cleanup after an early stop, sends nothing)."""
        if not self._stopped:
            self._stopped = True
            self._send(("stop", None))

    def flag(self, stop: bool) -> None:
        """Rank 0's decision at one progress report: go on (False) or leave the pipeline (True)."""
        broadcast_flag(self.layout, stop)

    def _send(self, message: tuple[str, Any]) -> None:
        dist.broadcast_object_list([message], src=0, group=self.layout.world_group)
        self._sent_at = time.monotonic()


class GroupProgress:
    """Rank 0's reporter for one job inside the pipeline: the job's own reporter (which raises
    JobStopped once its client stopped the job), then the decision broadcast to the other ranks."""

    def __init__(self, inner: Any, link: GroupLink) -> None:
        self._inner = inner
        self._link = link

    def stage(self, name: str, total: int) -> None:
        self._decide(lambda: self._inner.stage(name, total))

    def advance(self, units: int = 1) -> None:
        self._decide(lambda: self._inner.advance(units))

    def close(self) -> None:
        self._inner.close()

    def _decide(self, report: Any) -> None:
        try:
            report()
        except BaseException:  # stopped, or rank 0's own failure: every rank stops here
            self._link.flag(True)
            raise
        self._link.flag(False)


class FollowerProgress:
    """A following rank's reporter: at each report, rank 0's decision; JobStopped when it says stop."""

    def __init__(self, layout: ParallelLayout) -> None:
        self._layout = layout

    def stage(self, name: str, total: int) -> None:
        self._follow()

    def advance(self, units: int = 1) -> None:
        self._follow()

    def close(self) -> None:
        pass

    def _follow(self) -> None:
        if broadcast_flag(self._layout, False):
            raise JobStopped()


def broadcast_flag(layout: ParallelLayout, stop: bool) -> bool:
    """Rank 0's `stop` on every rank of the layout's world (one int tensor on the layout's device)."""
    flag = torch.tensor([1 if stop else 0], dtype=torch.int32, device=layout.collective_device)
    dist.broadcast(flag, src=0, group=layout.world_group)
    return bool(flag.item())


def follow(pipe: Any, layout: ParallelLayout) -> None:
    """A following rank: run every job rank 0 hands out, until rank 0 says stop."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=layout.world_group)
        kind, request = box[0]
        if kind == "stop":
            return
        if kind != "job":
            continue
        try:
            pipe.generate(request, progress=FollowerProgress(layout))
        except Exception:  # noqa: BLE001 - stopped by rank 0, or the same failure rank 0 meets and records
            continue
