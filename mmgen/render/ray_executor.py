"""Ray replicas for `mmgen render FILE --ray auto|ADDRESS [--replicas N]` (the `ray` extra).

Each replica is one Ray actor holding one loaded pipeline between jobs (one process; multi-rank
replicas, a placement group whose actors form one torch.distributed world, are not built yet). The
driver keeps one job in flight per replica and gives the next pending job to whichever replica
finishes first. A replica returns the job's frames and identity through Ray's object store; the
driver alone writes outputs and records (runner.write_job), so no shared filesystem is needed.

What each node needs: mmgen installed (the same version) and the model directory at the same path
(the embedded default model is built where it is missing). Before the first job every replica
checks that the model directory exists on its node; one that lacks it stops the render with one
line naming the node.

Faults: a replica that dies mid-job (its process killed, its node lost) is dropped and its job goes
back to the queue for another replica; it is recorded once, when it finishes. Every wait has a
timeout (connect, start + load, each job); a job that outlives its timeout kills its replica and is
recorded as failed. Leaving the `with` block (Ctrl-C included) kills every replica, and disconnects
from Ray when this executor connected.

Ray is imported here only, and only when the executor starts.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from mmgen.errors import MmgenError
from mmgen.progress import NullProgress
from mmgen.render.executors import RenderedJob, load_pipeline, render_job
from mmgen.render.schema import JobSpec, RenderPlan


@dataclass(frozen=True)
class RayTimeouts:
    """Seconds each wait may take: a replica's start and model load, one job. (Connecting is bounded
    by Ray's own connect timeout.)"""

    start: float = 600.0
    job: float = 3600.0


class Replica:
    """One Ray actor's state: the plan and, after load(), its pipeline (see the module docstring)."""

    def __init__(self, plan: RenderPlan, name: str):
        self.plan = plan
        self.name = name
        self.pipe: Any = None
        self.cold = True
        self.current: int | None = None

    def where(self) -> dict[str, Any]:
        """This replica's node, process and whether the plan's model directory is there."""
        model = self.plan.model
        missing = None if model == "default" or Path(model).is_dir() else model
        return {"node": socket.gethostname(), "pid": os.getpid(), "missing_model": missing}

    def load(self) -> float:
        """Load the pipeline; returns the seconds it took."""
        start = time.perf_counter()
        self.pipe = load_pipeline(self.plan)
        return time.perf_counter() - start

    def render(self, job: JobSpec) -> RenderedJob:
        """Run one job; a pipeline error comes back in the RenderedJob, never raised."""
        self.current = job.index
        try:
            rendered = render_job(
                self.plan, job, self.pipe, progress=NullProgress(), cold=self.cold, replica=self.name
            )
        finally:
            self.current = None
        self.cold = self.cold and not rendered.ok
        return replace(rendered, progress=None)  # a bar never crosses processes

    def running(self) -> int | None:
        """The index of the job this replica is rendering now (None when idle)."""
        return self.current


class RayExecutor:
    """`replicas` one-process Ray actors, each with its own pipeline; see the module docstring.

    address: 'auto' (a running cluster: `ray start --head` on this machine or RAY_ADDRESS), or a
    cluster address 'HOST:PORT' / 'ray://HOST:PORT'. When Ray is already initialized in this
    process (a test's local cluster) that connection is used and left open.
    runtime_env: handed to ray.init when this executor connects (e.g. env_vars for the workers).
    num_cpus / num_gpus: what each replica asks of Ray (default 1 CPU; 1 GPU when the plan's
    device is not 'cpu').
    log: told each replica's node, jobs and busy seconds when the executor closes.
    """

    def __init__(
        self,
        plan: RenderPlan,
        *,
        address: str = "auto",
        replicas: int = 1,
        timeouts: RayTimeouts | None = None,
        runtime_env: dict[str, Any] | None = None,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        log: Callable[[str], None] | None = None,
    ):
        if replicas < 1:
            raise MmgenError(f"--replicas {replicas}: need at least 1")
        self.plan = plan
        self.address = address
        self.replica_count = replicas
        self.timeouts = timeouts or RayTimeouts()
        self.runtime_env = runtime_env
        self.num_cpus = num_cpus
        self.num_gpus = (0.0 if plan.device == "cpu" else 1.0) if num_gpus is None else num_gpus
        self.tag = uuid.uuid4().hex[:8]
        self.load_seconds = 0.0
        self.actors: dict[str, Any] = {}  # replica name -> live actor handle
        self.where: dict[str, dict[str, Any]] = {}  # replica name -> its node, pid
        self.busy_seconds: dict[str, float] = {}  # replica name -> seconds spent rendering
        self.jobs_done: dict[str, int] = {}  # replica name -> jobs it returned
        self.log = log
        self.connected_here = False
        self.ray: Any = None

    def __enter__(self) -> RayExecutor:
        try:
            import ray
        except ImportError:
            raise MmgenError('--ray needs the ray extra: pip install "mmgen[ray]"') from None
        self.ray = ray
        if not ray.is_initialized():
            self._connect()
        try:
            self._start_replicas()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()
        if self.log is not None:
            for name, busy in self.busy_seconds.items():
                node = self.where.get(name, {}).get("node", "?")
                self.log(f"{name} on {node}: {self.jobs_done[name]} jobs, busy {busy:.2f}s")

    def _connect(self) -> None:
        ray = self.ray
        try:
            ray.init(
                address=self.address,
                runtime_env=self.runtime_env,
                include_dashboard=False,
                log_to_driver=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise MmgenError(f"--ray {self.address}: cannot connect to a Ray cluster ({err})") from None
        self.connected_here = True

    def _start_replicas(self) -> None:
        """Start every replica, check its node has the model, then load the pipelines (all bounded)."""
        ray = self.ray
        remote = ray.remote(Replica)
        for i in range(self.replica_count):
            name = f"mmgen-replica-{self.tag}-{i}"
            # max_concurrency 2: running() answers while render() works; the driver sends one job at a time
            options = remote.options(
                name=name, num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0, max_concurrency=2
            )
            self.actors[name] = options.remote(self.plan, name)
        names = list(self.actors)
        where = self._get([self.actors[n].where.remote() for n in names], self.timeouts.start, "start")
        for name, found in zip(names, where, strict=True):
            if found["missing_model"]:
                raise MmgenError(
                    f"node {found['node']} (replica {name}): model directory {found['missing_model']} "
                    "does not exist there; every node needs it at the same path"
                )
            self.where[name] = found
        loads = self._get([self.actors[n].load.remote() for n in names], self.timeouts.start, "model load")
        self.load_seconds = max(loads)
        self.busy_seconds = dict.fromkeys(names, 0.0)
        self.jobs_done = dict.fromkeys(names, 0)

    def _get(self, refs: list[Any], timeout: float, what: str) -> list[Any]:
        ray = self.ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise MmgenError(f"Ray replicas: {what} took over {timeout:g}s") from None
        except ray.exceptions.RayActorError as err:
            raise MmgenError(f"Ray replicas: a replica died during {what} ({_first_line(err)})") from None
        except ray.exceptions.RayTaskError as err:
            raise MmgenError(f"Ray replicas: {what} failed ({_first_line(err)})") from None

    def _stop(self) -> None:
        ray = self.ray
        if ray is None:
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                continue
        self.actors.clear()
        if self.connected_here:
            ray.shutdown()
            self.connected_here = False

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]:
        """Keep one job in flight per live replica; yield each RenderedJob as it finishes."""
        ray = self.ray
        queue = deque(jobs)
        in_flight: dict[Any, tuple[str, JobSpec, float]] = {}  # object ref -> (replica, job, deadline)
        idle = list(self.actors)
        while queue or in_flight:
            while queue and idle:
                name = idle.pop(0)
                job = queue.popleft()
                ref = self.actors[name].render.remote(job)
                in_flight[ref] = (name, job, time.monotonic() + self.timeouts.job)
            if not in_flight:  # jobs left, no replica left
                yield from (_failed(job, "no Ray replica left alive") for job in queue)
                return
            wait = max(0.0, min(deadline for _, _, deadline in in_flight.values()) - time.monotonic())
            ready, _ = ray.wait(list(in_flight), num_returns=1, timeout=wait)
            if not ready:
                yield from self._expire(in_flight)
                continue
            ref = ready[0]
            name, job, deadline = in_flight.pop(ref)
            try:
                rendered = ray.get(ref, timeout=self.timeouts.job)
            except ray.exceptions.RayActorError:  # the replica died mid-job: the job runs again elsewhere
                self.actors.pop(name, None)
                queue.appendleft(job)
                continue
            except ray.exceptions.RayTaskError as err:
                idle.append(name)
                yield _failed(job, f"replica {name}: {_first_line(err)}")
                continue
            self.busy_seconds[name] += float(rendered.timings.get("render", 0.0))
            self.jobs_done[name] += 1
            idle.append(name)
            yield rendered

    def _expire(self, in_flight: dict[Any, tuple[str, JobSpec, float]]) -> Iterator[RenderedJob]:
        """Fail every job past its deadline and kill its replica (it may be stuck for good)."""
        now = time.monotonic()
        for ref, (name, job, deadline) in list(in_flight.items()):
            if deadline <= now:
                del in_flight[ref]
                actor = self.actors.pop(name, None)
                if actor is not None:
                    self.ray.kill(actor)
                yield _failed(job, f"replica {name} took over {self.timeouts.job:g}s; replica stopped")


def _failed(job: JobSpec, error: str) -> RenderedJob:
    return RenderedJob(job.index, job.label, "ray", error=error)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
