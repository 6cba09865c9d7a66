"""Local process groups as an executor: `groups` torch.distributed worlds pulling jobs from one queue.

Each world (config.world_size spawned processes: NCCL on GPUs, gloo on the CPU) is one replica: it
loads the pipeline once on its ranks' layout and runs one job at a time over them (sequence / CFG
parallel inside the world). The client (render's driver, `mmgen generate --gpus`) puts every job on
one queue; each world's rank 0 takes the next job when it is free (a slow job never stalls the
other worlds), hands it to its ranks through the group link (group_link.py: the same protocol a
server's ranks follow) and sends the finished frames and identity back; the client alone writes
outputs and records. Each job is taken from the queue once, so each finished job is recorded once.
A kill stops every worker (they die with the launcher).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from mmgen.executors.group_link import GroupLink, follow
from mmgen.executors.in_process import InProcessExecutor, load_pipeline
from mmgen.executors.jobs import JobSpec, ModelSpec, RenderedJob
from mmgen.parallel.launch import run_worlds
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.progress import NullProgress
from pipelines.loader import resolve_device


class LocalGroupsExecutor:
    """`groups` local worlds of config.world_size spawned processes; each world is one replica."""

    def __init__(self, spec: ModelSpec, config: ParallelConfig, groups: int = 1):
        self.spec = spec
        self.config = config
        self.groups = groups
        self.load_seconds = 0.0
        self.failure: BaseException | None = None

    def __enter__(self) -> LocalGroupsExecutor:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]:
        """Start the worlds, yield each job's RenderedJob as a rank 0 sends it; a failing rank raises."""
        context = multiprocessing.get_context("spawn")
        todo, done, written = context.Queue(), context.Queue(), context.Queue()
        for job in jobs:
            todo.put(job)
        for _ in range(self.groups):
            todo.put(None)  # one stop mark per group
        launcher = threading.Thread(target=self._launch, args=(context, todo, done, written), daemon=True)
        launcher.start()
        received = 0
        try:
            while received < len(jobs):
                try:
                    rendered = done.get(timeout=0.1)
                except queue.Empty:
                    if launcher.is_alive():
                        continue
                    if done.empty():  # the worlds ended (or failed) without sending every job
                        break
                    continue
                received += 1
                yield rendered
                written.put(True)  # the client has written and recorded it: that rank 0 takes its next job
        finally:
            if received < len(jobs):  # the client stopped early (a full disk) or a rank failed: no new jobs
                with contextlib.suppress(queue.Empty):
                    while True:
                        todo.get_nowait()
                for _ in range(self.groups):
                    todo.put(None)
                    written.put(False)  # a rank 0 waiting on a job the client will not write
            launcher.join()
        if self.failure is not None:
            raise self.failure

    def _launch(self, context: Any, todo: Any, done: Any, written: Any) -> None:
        device_type = resolve_device(self.spec.device).partition(":")[0]
        try:
            loads = run_worlds(
                _group_worker,
                self.config,
                self.groups,
                (self.spec, todo, done, written),
                device_type=device_type,
                context=context,
            )
            self.load_seconds = max(loads)
        except BaseException as err:  # noqa: BLE001 - raised again in run(), in the client's thread
            self.failure = err


def _group_worker(layout: ParallelLayout, spec: ModelSpec, todo: Any, done: Any, written: Any) -> float:
    """One rank of one group: load the model once, then run the jobs its rank 0 takes; returns load seconds.

    Rank 0 hands each job to its ranks (group_link), sends the finished job to the client and waits
    until the client has written and recorded it (`written`): at most one job per group is ever
    rendered but unrecorded, so a killed run loses little. The other ranks follow rank 0."""
    start = time.perf_counter()
    pipe = load_pipeline(spec, parallel=layout)  # the one-process loader (host-first for offload)
    load_seconds = time.perf_counter() - start
    if not layout.owns_outputs:
        follow(pipe, layout)
        return load_seconds
    link = None if layout.is_single else GroupLink(layout)
    # The group's first job pays its start-up: recorded cold, so `mmgen ab` leaves it out of the ratios.
    replica = f"local group pid {os.getpid()}"
    executor = InProcessExecutor(
        spec, lambda: pipe, progress=lambda job: NullProgress(), link=link, replica=replica
    )
    try:
        with executor, contextlib.closing(executor.run(iter(todo.get, None))) as rendered_jobs:
            for rendered in rendered_jobs:
                done.put(rendered.portable())  # a reporter or a result never crosses processes
                if not written.get():
                    break
    finally:
        if link is not None:
            link.stop()  # the other ranks return
    return load_seconds
