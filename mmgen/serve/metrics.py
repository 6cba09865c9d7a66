"""Prometheus metrics of one server (its own registry: no process-wide collector is touched).

Queue depth and jobs by state are read from the job store at scrape time; latencies are observed
by the worker as jobs run.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from mmgen.serve.queue import JobStore

_STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_JOB_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class ServeMetrics:
    """The server's gauges, counters and histograms, and their text exposition."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("mmgen_queue_depth", "jobs waiting to run", registry=r)
        self.jobs = Gauge("mmgen_jobs", "jobs in the store by status", ["status"], registry=r)
        self.finished = Counter(
            "mmgen_jobs_finished", "jobs this process ended, by outcome", ["outcome"], registry=r
        )
        self.step_seconds = Histogram(
            "mmgen_step_seconds", "wall time of one denoising step", buckets=_STEP_BUCKETS, registry=r
        )
        self.job_seconds = Histogram(
            "mmgen_job_seconds", "wall time of a job, start to published", buckets=_JOB_BUCKETS, registry=r
        )
        self.queue_wait_seconds = Histogram(
            "mmgen_queue_wait_seconds",
            "time a job waited before it started",
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        # Under --ray: per replica, what it returned (mmgen.serve.replicas).
        self.replica_jobs = Counter("mmgen_replica_jobs", "jobs a replica returned", ["replica"], registry=r)
        self.replica_busy_seconds = Counter(
            "mmgen_replica_busy_seconds", "seconds a replica spent running jobs", ["replica"], registry=r
        )
        self.replica_lora_loads = Counter(
            "mmgen_replica_lora_loads", "LoRA sets a replica read and applied", ["replica"], registry=r
        )
        self.gpu_peak_bytes = Gauge(
            "mmgen_gpu_memory_peak_bytes", "peak GPU memory allocated by the worker (0 off CUDA)", registry=r
        )

    def exposition(self) -> bytes:
        counts = self._store.counts()
        self.queue_depth.set(counts["queued"])
        for status, count in counts.items():
            self.jobs.labels(status=status).set(count)
        return generate_latest(self.registry)
