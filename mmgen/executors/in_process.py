"""One pipeline in this process: InProcessExecutor, and what every replica runs per job (render_job).

render_job runs one job on a loaded pipeline and returns its RenderedJob (an error, a refusal or a
stop included, never raised); Ray replicas and local groups' rank 0 call it too, so a job's record
cannot depend on where it ran. load_pipeline loads a ModelSpec's pipeline (on a group's layout).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

import numpy as np

from mmgen.errors import MmgenError, ValidationError, one_line
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
    becomes the RenderedJob's error, never raised."""
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
            progress=progress,
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
        memory_gib=dict(getattr(result, "memory", {})),  # peak GPU memory per stage
        fingerprint=dict(result.fingerprint),
        attention_providers=dict(result.attention_providers),
        lora_loads=lora_loads(pipe) - loads,
        progress=progress,
    )


class InProcessExecutor:
    """One pipeline loaded here (`load()`; by default load_pipeline(spec)), jobs run one after another.

    show_progress: a bar per job (None: only on a terminal). warmed: the pipeline has run once
    already, untimed (`mmgen ab`'s warm-up), so the first job is not recorded cold."""

    def __init__(
        self,
        spec: ModelSpec,
        load: PipelineLoader | None = None,
        *,
        show_progress: bool | None = None,
        warmed: bool = False,
    ):
        self.spec = spec
        self.factory = load or (lambda: load_pipeline(spec))
        self.disable = None if show_progress is None else not show_progress
        self.warmed = warmed
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

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]:
        """Render each job in order; the job's bar stays open until the driver has written it."""
        if self.pipe is None:
            raise RuntimeError("InProcessExecutor.run outside its `with` block")
        cold = not self.warmed  # until a job renders, each one may still pay start-up
        for job in jobs:
            progress = job_progress(job, self.disable)
            try:
                rendered = render_job(
                    self.spec, job, self.pipe, progress=progress, cold=cold, replica="local"
                )
                cold = cold and not rendered.ok
                yield rendered
            finally:
                progress.close()


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
