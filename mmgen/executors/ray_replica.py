"""What each Ray actor of `mmgen render/serve --ray` runs: one loaded pipeline between jobs.

`Replica` loads the spec's pipeline (joining its multi-rank world first when it has several ranks),
renders the jobs the driver (mmgen.executors.ray_executor.RayExecutor) hands it and returns each as a
RenderedJob through Ray's object store; it answers progress and request checks while it renders.
A stop the driver asks for is raised (JobStopped) at the job's next progress report.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any

from mmgen.errors import MmgenError
from mmgen.executors.in_process import load_pipeline, render_job
from mmgen.executors.jobs import JobSpec, JobStopped, ModelSpec, RenderedJob
from mmgen.parallel.launch import init_process
from mmgen.parallel.layout import ParallelConfig, init_layout
from pipelines.loader import resolve_device
from pipelines.request import GenerationRequest


class StopFlagProgress:
    """A replica's reporter for one job: keeps (stage, done, total) for progress() and raises
    JobStopped at the next report once stop_job() named this job."""

    def __init__(self, replica: Replica, index: int) -> None:
        self._replica = replica
        self._index = index
        self.now: tuple[str, int, int] = ("", 0, 1)  # (stage, units done, units in the stage)

    def stage(self, name: str, total: int) -> None:
        self.now = (name, 0, max(int(total), 1))
        self._check()

    def advance(self, units: int = 1) -> None:
        name, done, total = self.now
        self.now = (name, done + units, total)
        self._check()

    def close(self) -> None:
        pass

    def _check(self) -> None:
        if self._replica.stopping == self._index:
            raise JobStopped(f"job {self._index} stopped by the driver")


class Replica:
    """One Ray actor's state: the spec and, after load(), its pipeline (see the module docstring)."""

    def __init__(self, spec: ModelSpec, name: str):
        self.spec = spec
        self.name = name
        self.pipe: Any = None
        self.cold = True
        self.current: int | None = None
        self.stopping: int | None = None
        self.reporter: StopFlagProgress | None = None  # the running job's (its stage and units)

    def where(self) -> dict[str, Any]:
        """This replica's node, process and whether the spec's model directory is there."""
        model = self.spec.model
        missing = None if model == "default" or Path(model).is_dir() else model
        return {"node": socket.gethostname(), "pid": os.getpid(), "missing_model": missing}

    def address(self) -> str:
        """A torch.distributed rendezvous address on this node (rank 0 of a multi-rank replica)."""
        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def load(
        self, config: ParallelConfig | None = None, rank: int = 0, address: str = "", timeout_s: float = 0
    ) -> float:
        """Load the pipeline (first joining the replica's torch.distributed world when config has
        several ranks: every rank calls this at once); returns the seconds it took."""
        start = time.perf_counter()
        layout = None
        if config is not None and config.world_size > 1:
            device_type = resolve_device(self.spec.device).partition(":")[0]
            # Ray shows each rank actor its one GPU as cuda:0: first_device + rank must be 0.
            device = init_process(
                rank, config.world_size, device_type, timeout_s, address, first_device=-rank
            )
            layout = init_layout(config, device)
        self.pipe = load_pipeline(self.spec, parallel=layout)
        return time.perf_counter() - start

    def describe(self) -> dict[str, Any]:
        """What a server reads from the model without a pipeline of its own (mmgen.serve.replicas.
        ModelFacts): its defaults and capabilities (pipelines.capabilities), any family."""
        return {"defaults": self.pipe.defaults, "capabilities": self.pipe.capabilities}

    def check_request(self, request: GenerationRequest) -> tuple[GenerationRequest | None, str]:
        """(the request with the model's defaults filled in, "") from the pipeline's own
        check_request, or (None, its refusal) when it refuses the request."""
        try:
            return self.pipe.check_request(request), ""
        except MmgenError as err:
            return None, str(err)

    def follow(self, job: JobSpec) -> None:
        """A rank other than 0 of a multi-rank replica: run its part of the job (rank 0 returns it)."""
        with contextlib.suppress(Exception):  # rank 0 meets the same error and returns it
            self.pipe.generate(job.request, progress=False)

    def render(self, job: JobSpec) -> RenderedJob:
        """Run one job; a pipeline error (JobStopped included) comes back in the RenderedJob, never raised."""
        self.current, self.reporter = job.index, StopFlagProgress(self, job.index)
        try:
            rendered = render_job(
                self.spec,
                job,
                self.pipe,
                progress=self.reporter,
                cold=self.cold,
                replica=self.name,
            )
        finally:
            self.current = None
        self.cold = self.cold and not rendered.ok
        return rendered.portable()  # its result stays here: the frames and identity go back

    def stop_job(self, index: int) -> None:
        """Stop job `index` at its next progress report, if it is the one running (or about to)."""
        self.stopping = index

    def running(self) -> int | None:
        """The index of the job this replica is rendering now (None when idle)."""
        return self.current

    def progress(self) -> tuple[int | None, str, int, int]:
        """(running job's index, stage, units done, units in the stage)."""
        now = ("", 0, 1) if self.reporter is None else self.reporter.now
        return (self.current, *now)
