"""Where a render's jobs run, as a value: an executor takes jobs and gives back what each produced.

An executor is a context manager with `run(jobs) -> Iterator[RenderedJob]` (one RenderedJob per
job, in the order they finish) and `load_seconds` (the slowest replica's model load, 0 before
`run`). It never writes: the driver (runner.run_render) writes each job's outputs through the atomic
writers and appends its manifest record, so a job is recorded once wherever it ran.

InProcessExecutor   one pipeline in this process (the one-process render)
LocalGroupsExecutor groups.py: local torch.distributed worlds of spawned processes (--gpus/--sp)
RayExecutor         ray_executor.py: Ray actors (ray_replica.py), one loaded pipeline each (the `ray` extra, imported there only)

A RenderedJob carries the raw uint8 frames, not encoded files: the driver encodes them with the same
writers a one-process render uses, so the bytes on disk cannot depend on where a job ran.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol

import numpy as np

from mmgen.errors import MmgenError, ValidationError, one_line
from mmgen.families import load_pipeline as _load
from mmgen.progress import NullProgress, ProgressReporter, TqdmProgress
from mmgen.render.schema import JobSpec, RenderPlan
from pipelines.devices import synchronize
from pipelines.loader import resolve_device, resolve_dtype

JOB_START_HOOK_ENV = "MMGEN_RENDER_JOB_START_FILE"


class Pipeline(Protocol):
    """A loaded pipeline of any family (Wan, Qwen-Image): one request in, a GenerationResult out."""

    def generate(self, request: Any, *, progress: Any = ...) -> Any: ...


PipelineFactory = Callable[[RenderPlan], Pipeline]


@dataclass(frozen=True)
class RenderedJob:
    """What one job produced where it ran: frames and identity, or the error that stopped it.

    frames: uint8 [T, H, W, 3] (None when the job failed). timings: the pipeline's stage seconds plus
    'render' (the whole call); 'cold' when it was the replica's first call (start-up included).
    replica: where it ran ('local', or a Ray replica's name and node). lora_loads: LoRA sets the
    pipeline read and applied for this job (0 when it kept the set its previous job left on).
    """

    index: int
    label: str
    replica: str
    frames: np.ndarray | None = None
    fps: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    frames_sha256: str | None = None
    latents_sha256: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    memory_gib: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    attention_providers: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    lora_loads: int = 0
    refused: bool = False  # the error is the request's (a ValidationError: sizes, inputs the model refuses)
    # The in-process per-job bar, kept open so the driver's export shows on it; never sent between processes.
    progress: ProgressReporter | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None


class Executor(Protocol):
    """Runs jobs and yields what each produced (see the module docstring)."""

    load_seconds: float

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]: ...

    def __enter__(self) -> Executor: ...

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None: ...


# Builds the executor for a plan's pending jobs (run_render calls it only when a job is pending).
ExecutorFactory = Callable[[RenderPlan], Executor]


def render_job(
    plan: RenderPlan,
    job: JobSpec,
    pipe: Pipeline,
    *,
    progress: ProgressReporter,
    cold: bool,
    replica: str,
) -> RenderedJob:
    """Run one job on a loaded pipeline; an exception becomes the RenderedJob's error (never raised)."""
    announce_job_start(job)
    start = time.perf_counter()
    loads = lora_loads(pipe)
    try:
        result = pipe.generate(job.request, progress=progress)
        synchronize(resolve_device(plan.device))  # the job's time covers finished work
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
        fps=plan.fps if plan.fps is not None else int(result.args.get("fps", 16)),
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
    """The one-process render: one pipeline loaded here, jobs run one after another."""

    def __init__(
        self,
        plan: RenderPlan,
        pipeline_factory: PipelineFactory | None = None,
        *,
        show_progress: bool | None = None,
        warmed: bool = False,
    ):
        self.plan = plan
        self.factory = pipeline_factory or load_pipeline
        self.disable = None if show_progress is None else not show_progress
        self.warmed = warmed
        self.load_seconds = 0.0
        self.pipe: Pipeline | None = None

    def __enter__(self) -> InProcessExecutor:
        start = time.perf_counter()
        self.pipe = self.factory(self.plan)
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
                    self.plan, job, self.pipe, progress=progress, cold=cold, replica="local"
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


def load_pipeline(
    plan: RenderPlan, *, parallel: Any = None, offload: str | None = None, gpu_memory_gb: float | None = None
) -> Pipeline:
    """Load the plan's model once (the embedded default when model is 'default').

    parallel: a ParallelLayout for one rank of a group render (mmgen.render.groups); None = one process.
    offload / gpu_memory_gb: the pipeline's default memory policy (a server's --offload / --gpu-memory-gb).
    """
    device = resolve_device(plan.device)
    # Jobs that offload or plan within a GPU budget need the weights loaded on the host first.
    offloading = any(
        job.request.offload in ("model", "layer") or job.request.gpu_memory_gb for job in plan.jobs
    )
    return _load(
        plan.model,
        task=plan.task,
        device=device,
        dtype=resolve_dtype(plan.dtype, device),
        load_on_host=offloading or None,
        parallel=parallel,
        offload=offload,
        gpu_memory_gb=gpu_memory_gb,
    )
