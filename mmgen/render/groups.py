"""`mmgen render FILE --gpus N [--sp S] [--ring R] [--cfg-parallel]`: groups of ranks pulling jobs from one queue.

N GPUs (CPU: gloo processes) form N / G groups of G = S x (2 with --cfg-parallel) ranks; each group
is its own torch.distributed world running one job at a time over its ranks (sequence / CFG
parallel inside the group). This is the local executor (mmgen.render.executors): the launcher, the
render's driver holding the output directory's lock, puts every pending job on one queue; each
group's rank 0 takes the next job when it is free (a slow job never stalls the other groups), hands
it to its ranks and sends the finished frames and identity back; the driver alone writes the outputs
and appends the manifest record, exactly as a one-process render does (runner.write_job). Each job
is taken from the queue once, so each finished job is recorded once. A kill stops every worker (they
die with the launcher) and a rerun, with any group count, resumes from the manifest like a
one-process render.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch.distributed as dist

from mmgen.errors import ValidationError
from mmgen.parallel.launch import run_worlds
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.progress import NullProgress
from mmgen.render.executors import RenderedJob, load_pipeline, render_job
from mmgen.render.runner import RenderSummary, run_render
from mmgen.render.schema import JobSpec, RenderPlan
from pipelines.loader import resolve_device


def render_groups(gpus: int, sp: int | None, ring: int, cfg: bool) -> tuple[ParallelConfig, int]:
    """(each group's ParallelConfig, number of groups) for --gpus/--sp/--ring/--cfg-parallel; sp defaults to 1."""
    config = ParallelConfig(sp=1 if sp is None else sp, ring=ring, cfg=cfg)
    if not isinstance(gpus, int) or gpus < 1 or gpus % config.world_size:
        raise ValidationError(
            f"--gpus {gpus} does not split into groups of {config.world_size} "
            f"(--sp {config.sp}{' x 2 for --cfg-parallel' if cfg else ''}); use a multiple of {config.world_size}"
        )
    return config, gpus // config.world_size


def run_render_groups(
    plan: RenderPlan,
    config: ParallelConfig,
    groups: int,
    *,
    resume: bool = True,
    save_frames: bool = False,
    replace_others: bool = False,
) -> RenderSummary:
    """Render the plan's pending jobs on `groups` worlds of config.world_size ranks (see the module docstring)."""
    return run_render(
        plan,
        resume=resume,
        save_frames=save_frames,
        show_progress=False,
        replace_others=replace_others,
        executor=lambda p: LocalGroupsExecutor(p, config, groups),
    )


class LocalGroupsExecutor:
    """`groups` local worlds of config.world_size spawned processes; each world is one replica."""

    def __init__(self, plan: RenderPlan, config: ParallelConfig, groups: int):
        self.plan = plan
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
            todo.put(job.index)
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
                written.put(True)  # the driver has written and recorded it: that rank 0 takes its next job
        finally:
            if received < len(jobs):  # the driver stopped early (a full disk) or a rank failed: no new jobs
                with contextlib.suppress(queue.Empty):
                    while True:
                        todo.get_nowait()
                for _ in range(self.groups):
                    todo.put(None)
                    written.put(False)  # a rank 0 waiting on a job the driver will not write
            launcher.join()
        if self.failure is not None:
            raise self.failure

    def _launch(self, context: Any, todo: Any, done: Any, written: Any) -> None:
        device_type = resolve_device(self.plan.device).partition(":")[0]
        try:
            loads = run_worlds(
                _group_worker,
                self.config,
                self.groups,
                (self.plan, todo, done, written),
                device_type=device_type,
                context=context,
            )
            self.load_seconds = max(loads)
        except BaseException as err:  # noqa: BLE001 - raised again in run(), in the driver's thread
            self.failure = err


def _group_worker(layout: ParallelLayout, plan: RenderPlan, todo: Any, done: Any, written: Any) -> float:
    """One rank of one group: load the model once, then run the jobs its rank 0 takes; returns load seconds.

    Rank 0 sends each finished job to the driver and waits until the driver has written and recorded
    one (`written`), as a group that wrote its own outputs did: at most one job per group is ever
    rendered but unrecorded, so a killed render loses little."""
    start = time.perf_counter()
    pipe = load_pipeline(plan, parallel=layout)  # the one-process render's loader (host-first for offload)
    load_seconds = time.perf_counter() - start
    by_index = {job.index: job for job in plan.jobs}
    # The group's first job pays its start-up: recorded cold, so `mmgen ab` leaves it out of the ratios.
    cold = True
    while True:
        index = todo.get() if layout.owns_outputs else None
        if not layout.is_single:
            box = [index]
            dist.broadcast_object_list(box, src=0, group=layout.world_group)
            index = box[0]
        if index is None:
            return load_seconds
        job = by_index[index]
        if layout.owns_outputs:
            rendered = render_job(
                plan, job, pipe, progress=NullProgress(), cold=cold, replica=f"local group pid {os.getpid()}"
            )
            cold = cold and not rendered.ok
            done.put(replace(rendered, progress=None))  # a bar never crosses processes
            written.get()
            continue
        try:
            pipe.generate(job.request, progress=False)
        except Exception:  # noqa: BLE001 - rank 0 meets the same error and records the job as failed
            continue
