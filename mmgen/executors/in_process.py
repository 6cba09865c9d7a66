"""One pipeline in this process: InProcessExecutor, and what every replica runs per job (render_job).

render_job runs one job on a loaded pipeline and returns its RenderedJob (an error, a refusal or a
stop included, never raised); Ray replicas call it too, so a job's record cannot depend on where it
ran. InProcessExecutor is what every process that owns a pipeline runs its jobs through: render's
driver, a local group's rank 0 (groups.py), a server's worker (alone or rank 0 of `serve --gpus`) and
`mmgen generate` (alone or rank 0 of `--gpus`); as rank 0 of a group it leads the other ranks
(group_link.py), which follow. load_pipeline loads a ModelSpec's pipeline (on a group's layout).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import numpy as np

from mmgen.errors import MmgenError, ValidationError, one_line
from mmgen.executors.group_link import GroupLink, GroupProgress
from mmgen.executors.jobs import JobSpec, JobStopped, ModelSpec, RenderedJob
from mmgen.executors.protocol import Pipeline, PipelineLoader
from mmgen.families import load_pipeline as _load
from mmgen.progress import NullProgress, ProgressReporter, TqdmProgress
from pipelines.devices import synchronize
from pipelines.loader import resolve_device, resolve_dtype

JOB_START_HOOK_ENV = "MMGEN_RENDER_JOB_START_FILE"


def render_job(
    spec: ModelSpec,
    job: JobSpec,
    pipe: Pipeline,
    *,
    progress: ProgressReporter,
    cold: bool,
    replica: str,
) -> RenderedJob:
    """Run one job on a loaded pipeline; an exception (JobStopped included: `stopped` is then set)
    becomes the RenderedJob's error, never raised. The RenderedJob keeps the pipeline's result (its
    `result`: drop it with portable() before sending the job to another process)."""
    announce_job_start(job)
    start = time.perf_counter()
    loads = lora_loads(pipe)
    try:
        result = pipe.generate(job.request, progress=progress)
        synchronize(resolve_device(spec.device))  # the job's time covers finished work
    except Exception as err:  # a failed job is recorded and the batch goes on
        message = one_line(err, typed=True)
        trace = None if isinstance(err, MmgenError) else traceback.format_exc(limit=8)
        return RenderedJob(
            job.index,
            job.label,
            replica,
            timings={"render": time.perf_counter() - start},
            error=message,
            traceback=trace,
            lora_loads=lora_loads(pipe) - loads,
            refused=isinstance(err, ValidationError),
            stopped=isinstance(err, JobStopped),
        )
    timings = {**dict(result.timings), "render": time.perf_counter() - start}
    if cold:
        timings["cold"] = True
    return RenderedJob(
        job.index,
        job.label,
        replica,
        frames=np.asarray(result.frames),
        fps=spec.fps if spec.fps is not None else int(result.args.get("fps", 16)),
        args=dict(result.args),
        frames_sha256=result.frames_sha256,
        latents_sha256=result.latents_sha256,
        timings=timings,
        memory_gib=dict(result.memory),  # peak GPU memory per stage
        fingerprint=dict(result.fingerprint),
        attention_providers=dict(result.attention_providers),
        lora_loads=lora_loads(pipe) - loads,
        result=result,
    )


class InProcessExecutor:
    """One pipeline loaded here (`load()`; by default load_pipeline(spec)), jobs run one after another.

    Each job's reporter: `progress(job)` (a server's JobProgress, the command line's bar), by default
    a bar per job (show_progress; None: only on a terminal). warmed: the pipeline has run once
    already, untimed (`mmgen ab`'s warm-up), so the first job is not recorded cold. link: this process
    is rank 0 of a local group (group_link.py): each job is handed to the group and every progress
    report's decision broadcast, so every rank makes the same call and leaves it at the same step (the
    link's owner stops the group). replica: where the jobs ran, as their RenderedJob says."""

    def __init__(
        self,
        spec: ModelSpec,
        load: PipelineLoader | None = None,
        *,
        show_progress: bool | None = None,
        warmed: bool = False,
        progress: Callable[[JobSpec], ProgressReporter] | None = None,
        link: GroupLink | None = None,
        replica: str = "local",
    ):
        self.spec = spec
        self.factory = load or (lambda: load_pipeline(spec))
        disable = None if show_progress is None else not show_progress
        self.progress = progress or (lambda job: job_progress(job, disable))
        self.warmed = warmed
        self.link = link
        self.replica = replica
        self.load_seconds = 0.0
        self.pipe: Pipeline | None = None

    def __enter__(self) -> InProcessExecutor:
        start = time.perf_counter()
        self.pipe = self.factory()
        self.load_seconds = time.perf_counter() - start
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.pipe = None

    def run(self, jobs: Iterable[JobSpec]) -> Iterator[RenderedJob]:
        """Render each job in order (jobs may be a queue's iterator); the job's reporter stays open
        until the client has written it (its RenderedJob's `progress`)."""
        if self.pipe is None:
            raise RuntimeError("InProcessExecutor.run outside its `with` block")
        cold = not self.warmed  # until a job renders, each one may still pay start-up
        for job in jobs:
            progress = self.progress(job)
            try:
                lead = self._lead(job, progress)
                rendered = render_job(
                    self.spec, job, self.pipe, progress=lead, cold=cold, replica=self.replica
                )
                cold = cold and not rendered.ok
                yield replace(rendered, progress=progress)
            finally:
                progress.close()

    def _lead(self, job: JobSpec, progress: ProgressReporter) -> ProgressReporter:
        """The reporter the pipeline gets: the job's own, or, as rank 0 of a group, the job handed to
        every rank first and each report's decision (go on, or JobStopped) broadcast to them."""
        if self.link is None:
            return progress
        self.link.job(job.request)
        return GroupProgress(progress, self.link)


def lora_loads(pipe: Pipeline) -> int:
    """LoRA sets the pipeline has read and applied so far (mmgen.lora.LoRASlot.loads; 0 without a slot)."""
    slot = getattr(pipe, "loras", None)
    return int(getattr(slot, "loads", 0))


def announce_job_start(job: JobSpec) -> None:
    """The test hook: append '<index> <label>' to the file MMGEN_RENDER_JOB_START_FILE names, if set."""
    hook = os.environ.get(JOB_START_HOOK_ENV)
    if hook:
        with open(hook, "a", encoding="utf-8") as fh:
            fh.write(f"{job.index} {job.label}\n")
            fh.flush()
            os.fsync(fh.fileno())


def job_progress(job: JobSpec, disable: bool | None) -> ProgressReporter:
    """A per-job bar (denoise steps, decode, export) under the bar over jobs; none when bars are off."""
    if disable is None:
        disable = not sys.stderr.isatty()
    return NullProgress() if disable else TqdmProgress(desc=job.label, position=1, leave=False)


def load_pipeline(spec: ModelSpec, *, parallel: Any = None) -> Pipeline:
    """Load the spec's model once (the embedded default when model is 'default').

    parallel: a ParallelLayout for one rank of a group (groups.py, a Ray replica); None = one process.
    """
    device = resolve_device(spec.device)
    return _load(
        spec.model,
        task=spec.task,
        device=device,
        dtype=resolve_dtype(spec.dtype, device),
        load_on_host=spec.load_on_host,
        parallel=parallel,
        offload=spec.offload,
        gpu_memory_gb=spec.gpu_memory_gb,
    )
