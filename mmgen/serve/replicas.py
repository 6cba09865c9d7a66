"""`mmgen serve --ray auto|ADDRESS [--replicas N]`: the one durable queue drained by N Ray replicas.

The HTTP process alone owns the queue (SQLite) and the output files, as with one process: its
worker thread claims a job only when a replica is free (so queued jobs stay FIFO and cancellable
in the store), hands it to the Ray executor (mmgen.executors.ray_executor: the same replica
actors as `mmgen render --ray`, the same LoRA-aware choice of replica), and when a replica returns
the frames and identity writes them with the pipeline's atomic writer and publishes the row through
the one-process worker's own path (Worker.end_job / Worker.write).

    worker thread                                  replica (Ray actor, one pipeline)
    claim a job (queued -> in_progress)        ->  render(job): the same pipeline call
    every PROGRESS_WRITE_S: progress, cancel   ->  progress() / stop_job(): stops at the next step
    frames + identity come back                <-  RenderedJob
    write the output, publish the row

Cancellation: a DELETE flags the row; the worker asks the replica to stop the job at its next
progress report, and the job ends cancelled with nothing published. A replica lost mid-job is
replaced and its job runs again (same seed, same SHA); kill -9 of this process takes its replicas
with it (Ray ends the actors of a dead driver) and a restart re-queues what was running
(JobStore.recover). /health is 200 once every replica has loaded; the HTTP side checks requests
before queueing them without a pipeline of its own (ModelFacts: the defaults and capabilities a
replica reports): the served pipeline's own check_request runs on a replica, whatever the family,
through a remote call answered even while the replica renders (bounded: a replica that does not
answer is a 503, never a 400).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mmgen.errors import MmgenError
from mmgen.executors.jobs import JobSpec, JobStopped, RenderedJob, ReplicaUnavailable
from mmgen.serve.metrics import ServeMetrics
from mmgen.serve.protocol import ApiError
from mmgen.serve.queue import Job, JobStore
from mmgen.serve.worker import IDLE_POLL_S, PROGRESS_WRITE_S, Worker, stage_progress
from pipelines.capabilities import Capabilities
from pipelines.request import GenerationRequest

STEP_WAIT_S = 0.2  # how long one executor step waits for a replica while jobs run


@dataclass(frozen=True)
class ModelFacts:
    """The served model as a replica describes it (Replica.describe): what the server reads from a
    pipeline (its defaults and capabilities), and `remote_check`, which has a replica's pipeline
    check a request (RayExecutor.check_request)."""

    defaults: Any
    capabilities: Capabilities
    remote_check: Callable[[GenerationRequest], GenerationRequest]

    def check_request(self, request: GenerationRequest) -> GenerationRequest:
        """The request with the model's defaults filled in, or the pipeline's refusal (an MmgenError:
        a 400 naming the field): the served pipeline's own check_request, run by a replica (any
        family); ApiError 503 when no replica answers in time."""
        try:
            return self.remote_check(request)
        except ReplicaUnavailable as err:
            raise ApiError(503, f"{err}; retry shortly", kind="service_unavailable") from None


@dataclass(frozen=True)
class Running:
    """A claimed job on the executor: its row, when it was claimed, whether a stop was asked."""

    job: Job
    started: float
    stopping: bool = False


class RayWorker(Worker):
    """The Worker whose jobs run on an executor's replicas (module docstring). `executor()` builds
    it (not yet started: the worker thread starts it, so /health answers while replicas load)."""

    def __init__(
        self,
        store: JobStore,
        executor: Callable[[], Any],
        outputs: Path,
        metrics: ServeMetrics | None = None,
        *,
        on_ready: Callable[[Any], None] | None = None,
    ) -> None:
        super().__init__(store, self._no_pipeline, outputs, metrics, on_ready=on_ready)
        self._executor = executor
        self._running: dict[int, Running] = {}  # job seq (the executor's job index) -> its job

    @staticmethod
    def _no_pipeline() -> Any:
        raise AssertionError("RayWorker loads no pipeline in this process")

    def _run(self) -> None:
        executor = self._executor()
        try:
            executor.__enter__()
        except Exception as err:  # replicas failed to start or load: the worker ends; /health says why
            self.load_error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            return
        try:
            if self._on_ready is not None:
                self._on_ready(ModelFacts(**executor.describe(), remote_check=executor.check_request))
            self._ready.set()
            self._serve(executor)
        except Exception as err:  # noqa: BLE001 - the worker ends; /health says why
            self.load_error = f"{type(err).__name__}: {err}"
            traceback.print_exc()
        finally:
            executor.__exit__(None, None, None)

    def _serve(self, executor: Any) -> None:
        watched = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before claiming: a job queued after the claim sets it again
            self._claim(executor)
            for rendered in executor.step(STEP_WAIT_S if self._running else 0.0):
                self._end(rendered)
            if time.monotonic() - watched >= PROGRESS_WRITE_S:
                watched = time.monotonic()
                self._watch(executor)
            if not executor.alive():  # every replica lost or stopped: /health says so
                raise MmgenError("no Ray replica left alive; restart the server")
            if not self._running:
                self._wake.wait(IDLE_POLL_S)

    def _claim(self, executor: Any) -> None:
        """Claim queued jobs (FIFO) while a replica is free and hand them to the executor."""
        while executor.capacity() > 0:
            job = self.store.claim()
            if job is None:
                return
            started = time.perf_counter()
            try:
                request = GenerationRequest.from_call(**job.fields)
            except Exception as err:  # noqa: BLE001 - e.g. an upload gone since: fails this job only
                self.end_job(job, _raise(err), started)
                continue
            self._running[job.seq] = Running(job, started)
            executor.submit(JobSpec(index=job.seq, name=job.id, request=request))

    def _watch(self, executor: Any) -> None:
        """Per running job: stop it once cancelled; else record its progress."""
        for seq, running in list(self._running.items()):
            job_id = running.job.id
            if self.store.cancel_requested(job_id):
                if not running.stopping:
                    self._running[seq] = running = replace(running, stopping=True)
                    if executor.stop_job(seq):  # still waiting for a replica: ends now
                        del self._running[seq]
                        self.end_job(running.job, _raise(JobStopped(job_id)), running.started)
                continue
            found = executor.job_progress(seq)
            if found is not None:
                progress = stage_progress(*found)
                self.live = (job_id, progress)
                self.store.set_progress(job_id, progress)

    def _end(self, rendered: RenderedJob) -> None:
        running = self._running.pop(rendered.index)
        self.end_job(running.job, lambda output, started: self.write(running.job, rendered, output, started))
        if self.metrics is not None and rendered.timings:
            self.metrics.replica_jobs.labels(replica=rendered.replica).inc()
            self.metrics.replica_busy_seconds.labels(replica=rendered.replica).inc(
                float(rendered.timings.get("render", 0.0))
            )
            self.metrics.replica_lora_loads.labels(replica=rendered.replica).inc(rendered.lora_loads)


def _raise(err: BaseException) -> Callable[[Path, float], str]:
    """A `produce` for Worker.end_job that ends the job with `err`."""

    def produce(output: Path, started: float) -> str:
        raise err

    return produce
