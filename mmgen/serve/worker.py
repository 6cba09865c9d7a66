"""The worker: one thread that owns the loaded pipeline and runs the queue's jobs FIFO.

The HTTP side never waits on it: it writes jobs to the store and reads their rows back. Per job the
worker rebuilds the GenerationRequest from the stored fields and runs it through an in-process
executor (mmgen.executors.in_process) with a JobProgress as its reporter, then writes the frames
through the pipeline's atomic writer under the state dir and publishes the row (`write`, the one
path from a RenderedJob to a published row: the Ray worker's jobs take it too). JobProgress records
progress after every denoising step and raises JobStopped (mmgen.executors' one stop signal) there
once the job was cancelled, so a cancelled job stops between steps and publishes nothing. With a
process group (`mmgen serve --gpus N`, mmgen.executors.group_link) this worker is rank 0's: its
executor hands each job to the group and broadcasts its stop decision per step.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mmgen.errors import MmgenError, ValidationError, one_line
from mmgen.executors.group_link import GroupLink
from mmgen.executors.in_process import InProcessExecutor
from mmgen.executors.jobs import JobSpec, JobStopped, ModelSpec, RenderedJob
from mmgen.outputs.writers import file_sha256, remove_stale_temps
from mmgen.serve.metrics import ServeMetrics
from mmgen.serve.queue import Job, JobStore
from pipelines.request import GenerationRequest

# Progress (0-100) at the start of each stage and the share of the bar it fills.
_STAGE_SPANS = {"denoise": (0, 90), "decode": (90, 8), "export": (98, 2)}
IDLE_POLL_S = 0.5
PROGRESS_WRITE_S = 0.5
GROUP_FAULT_GRACE_S = 2.0  # how long a group's server error waits for the launcher (see _settle_group)


def stage_progress(stage: str, done: int, total: int) -> int:
    """A job's progress (0-99 while it runs) after `done` of `total` units of `stage`."""
    start, span = _STAGE_SPANS.get(stage, (0, 0))
    return min(99, start + span * min(done, total) // max(total, 1))


class JobProgress:
    """A ProgressReporter (mmgen.progress) for one job: after each unit it publishes the progress to
    `live` (what GET answers while the job runs), writes it to the store at most every
    PROGRESS_WRITE_S (a committed write costs an fsync: per step it would slow small jobs), observes
    step times, and raises JobStopped once the store says the job was cancelled."""

    def __init__(
        self,
        store: JobStore,
        job_id: str,
        metrics: ServeMetrics | None = None,
        live: Callable[[str, int], None] | None = None,
    ) -> None:
        self._store = store
        self._job_id = job_id
        self._metrics = metrics
        self._live = live
        self._stage = ""
        self._total = 1
        self._done = 0
        self._tick = time.perf_counter()
        self._written_at = -PROGRESS_WRITE_S
        self.reported = 0

    def stage(self, name: str, total: int) -> None:
        self._stage, self._total, self._done = name, max(total, 1), 0
        self._tick = time.perf_counter()
        self._report()

    def advance(self, units: int = 1) -> None:
        now = time.perf_counter()
        if self._stage == "denoise" and self._metrics is not None:
            self._metrics.step_seconds.observe((now - self._tick) / max(units, 1))
        self._tick = now
        self._done += units
        self._report()

    def close(self) -> None:
        pass

    def _report(self) -> None:
        progress = stage_progress(self._stage, self._done, self._total)
        self.reported = progress
        if self._live is not None:
            self._live(self._job_id, progress)
        now = time.monotonic()
        if now - self._written_at >= PROGRESS_WRITE_S:
            self._written_at = now
            cancelled = self._store.set_progress(self._job_id, progress)
        else:  # a read: no fsync
            cancelled = self._store.cancel_requested(self._job_id)
        if cancelled:
            raise JobStopped(self._job_id)


class Worker:
    """Loads the pipeline (in its own thread, so the server answers /health while it loads), then
    runs jobs until stopped. `load()` returns the pipeline, handed to `on_ready` once; outputs go
    to `outputs`. `group`: rank 0's link to the other ranks of the pipeline's layout (None: alone).
    `spec`: what `load` loads (its device: a job's time waits for its queued work); None: on the CPU."""

    def __init__(
        self,
        store: JobStore,
        load: Callable[[], Any],
        outputs: Path,
        metrics: ServeMetrics | None = None,
        *,
        on_ready: Callable[[Any], None] | None = None,
        group: GroupLink | None = None,
        spec: ModelSpec | None = None,
    ) -> None:
        self.store = store
        self.group = group
        self.spec = spec or ModelSpec(model="", device="cpu")
        self._executor: InProcessExecutor | None = None  # made at the first job, on its pipeline
        self._on_ready = on_ready
        self.outputs = Path(outputs)
        self.metrics = metrics
        self._load = load
        self._ready = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmgen-serve-worker", daemon=True)
        self.load_error: str | None = None
        # (job id, progress) of the running job, newer than its row between store writes.
        self.live: tuple[str, int] | None = None
        self._gpu_peak_gib = 0.0

    def start(self) -> None:
        self.outputs.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.outputs)  # what a killed encode left; never served
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def wake(self) -> None:
        """A job was queued: look now rather than at the next poll."""
        self._wake.set()

    @property
    def ready(self) -> bool:
        """The model is loaded and the worker thread is alive."""
        return self._ready.is_set() and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            pipe = self._load()
            if self._on_ready is not None:
                self._on_ready(pipe)
        except Exception as err:  # a load failure ends the worker; /health says why
            self.load_error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            if self.group is not None:
                self._stop_group()  # ranks that did load return instead of waiting for a job
            return
        self._ready.set()
        while not self._stop.is_set():
            self._wake.clear()  # before claiming: a job queued after the claim sets it again
            job = self.store.claim()
            if job is None:
                if self.group is not None:
                    self.group.idle()
                self._wake.wait(IDLE_POLL_S)
                continue
            self.run_job(pipe, job)
        if self.group is not None:
            self._stop_group()  # the other ranks return; the launcher then sees every rank finish

    def _stop_group(self) -> None:
        assert self.group is not None
        try:
            self.group.stop()
        except Exception as err:  # a rank already gone (killed): nothing left to stop
            print(f"mmgen serve: stopping the other ranks: {one_line(err)}", file=sys.stderr, flush=True)

    def run_job(self, pipe: Any, job: Job) -> None:
        """Run one claimed job to completed, failed or cancelled; never raises for the job's own errors."""
        self.end_job(job, lambda output, started: self._generate(pipe, job, output, started))

    def end_job(self, job: Job, produce: Callable[[Path, float], str], started: float | None = None) -> None:
        """Bring a claimed job to completed, failed or cancelled: `produce(output path, started)`
        writes and publishes it ('completed' / 'cancelled') or raises JobStopped, ValidationError
        (the request's fault), MmgenError or any other error (the server's). `started`: when its
        work began (perf_counter; now by default)."""
        started = time.perf_counter() if started is None else started
        if self.metrics is not None:
            self.metrics.queue_wait_seconds.observe(max(0.0, (job.started_at or 0) - job.created_at))
        output = self.outputs / f"{job.id}{'.png' if job.kind == 'image' else '.mp4'}"
        try:
            outcome = produce(output, started)
        except JobStopped:
            output.unlink(missing_ok=True)
            self.store.finish(job.id, "cancelled")
            outcome = "cancelled"
        except ValidationError as err:  # what the model refuses (its own sizes, an image for T2V)
            self.store.finish(job.id, "failed", {"code": "invalid_request", "message": one_line(err)})
            outcome = "failed"
        except MmgenError as err:  # a load or write failure (a full disk): the server's, not the request's
            self._settle_group()
            self.store.finish(job.id, "failed", {"code": "server_error", "message": one_line(err)})
            outcome = "failed"
        except Exception as err:  # any other failure fails this job only; the worker goes on
            traceback.print_exc(file=sys.stderr)
            self._settle_group()
            self.store.finish(
                job.id, "failed", {"code": "server_error", "message": one_line(err, typed=True)}
            )
            outcome = "failed"
        if self.metrics is not None:
            self.metrics.finished.labels(outcome=outcome).inc()
            if outcome == "completed":
                self.metrics.job_seconds.observe(time.perf_counter() - started)

    def _settle_group(self) -> None:
        """Before recording a group job's server error: it may be a lost rank's (a closed connection
        in a collective). The launcher, which watches every rank, then stops this process within
        GROUP_FAULT_GRACE_S and records the job's failure naming the rank (mmgen.serve.cli)."""
        if self.group is not None:
            time.sleep(GROUP_FAULT_GRACE_S)

    def _publish_progress(self, job_id: str, progress: int) -> None:
        self.live = (job_id, progress)  # one assignment: readers see the old pair or the new one

    def progress_of(self, job: Job) -> int:
        """A running job's latest progress (the worker's, else its row's)."""
        live = self.live
        return (
            live[1]
            if live is not None and live[0] == job.id and job.status == "in_progress"
            else job.progress
        )

    def _generate(self, pipe: Any, job: Job, output: Path, started: float) -> str:
        request = GenerationRequest.from_call(**job.fields)
        spec = JobSpec(index=job.seq, name=job.id, request=request)
        with contextlib.closing(self._executor_on(pipe).run([spec])) as rendered_jobs:
            return self.write(job, next(rendered_jobs), output, started)

    def _executor_on(self, pipe: Any) -> InProcessExecutor:
        """The executor running jobs on `pipe`, made at its first job: each job's JobProgress as its
        reporter, and as rank 0 of a group, every job led over the group."""
        if self._executor is None or self._executor.pipe is not pipe:
            executor = InProcessExecutor(
                self.spec, lambda: pipe, progress=lambda job: self._job_progress(job.label), link=self.group
            )
            self._executor = executor.__enter__()  # loads nothing: `pipe` is loaded
        return self._executor

    def _job_progress(self, job_id: str) -> JobProgress:
        """A job's reporter (its label in the executor is its id)."""
        return JobProgress(self.store, job_id, self.metrics, self._publish_progress)

    def write(self, job: Job, rendered: RenderedJob, output: Path, started: float) -> str:
        """Bring what a job produced (here, or on a replica) to its published row: its failure raised
        by kind (end_job maps it: stopped -> cancelled, refused -> invalid_request, else
        server_error), the export reported on the job's progress (a cancel there stops it), the
        frames written with the pipeline's atomic writer, the row published."""
        if rendered.traceback is not None and not rendered.stopped:  # unexpected (no MmgenError): where
            print(rendered.traceback, file=sys.stderr, end="", flush=True)
        rendered.raise_failure()
        progress = rendered.progress or self._job_progress(job.id)  # a replica's job: its export here
        progress.stage("export", 1)
        tick = time.perf_counter()
        path = rendered.save(output, fps=job.options.get("fps"))
        export = time.perf_counter() - tick
        progress.advance()
        found = {
            "frames_sha256": rendered.frames_sha256,
            "latents_sha256": rendered.latents_sha256,
            "timings": {**rendered.stage_timings, "export": export},
            "fingerprint": rendered.fingerprint,
            "request": rendered.args,
            "memory_gib": rendered.memory_gib,
            "replica": rendered.replica,
        }
        return self.publish(job, path, found, started)

    def publish(self, job: Job, path: Path, found: dict[str, Any], started: float) -> str:
        """Publish a job whose output is written at `path`: its row gets `found` (frames_sha256,
        latents_sha256, timings with export, fingerprint, request, memory_gib, ...) plus queue_wait
        and job seconds. Returns 'completed', or 'cancelled' (output removed) when the job was
        cancelled or deleted after its last step."""
        # queue_wait: submitted -> claimed; job: claimed -> about to publish (the pipeline, the
        # export and the server's own work per job: job - total - export).
        timings = {
            **found["timings"],
            "queue_wait": max(0.0, (job.started_at or job.created_at) - job.created_at),
            "job": time.perf_counter() - started,
        }
        record = {**found, "timings": timings}
        memory = found.get("memory_gib") or {}
        if self.metrics is not None and memory:
            self._gpu_peak_gib = max(self._gpu_peak_gib, *memory.values())
            self.metrics.gpu_peak_bytes.set(self._gpu_peak_gib * 2**30)
        if not self.store.complete(job.id, record, str(path), file_sha256(path)):
            path.unlink(missing_ok=True)  # cancelled or deleted after its last step: never published
            self.store.finish(job.id, "cancelled")
            return "cancelled"
        return "completed"
