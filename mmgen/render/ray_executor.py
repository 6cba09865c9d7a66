"""Ray replicas for `mmgen render FILE --ray auto|ADDRESS [--replicas N] [--sp S] [--cfg-parallel]` (the `ray` extra).

Each replica holds one loaded pipeline between jobs: one Ray actor, or with several ranks (SP x CFG)
that many actors in one placement group packed on one node, forming one torch.distributed world
(NCCL on GPUs, gloo on the CPU) as a local render group does; rank 0 returns each job. The
driver keeps one job in flight per replica and gives the next pending job to whichever replica
finishes first. A replica returns the job's frames and identity through Ray's object store; the
driver alone writes outputs and records (runner.write_job), so no shared filesystem is needed.

What each node needs: mmgen installed (the same version) and the model directory at the same path
(the embedded default model is built where it is missing). Before the first job every replica
checks that the model directory exists on its node; one that lacks it stops the render with one
line naming the node.

Faults: a replica that dies mid-job (its process killed, its node lost) is dropped and its job goes
back to the queue for another replica; it is recorded once, when it finishes. (When a rank other
than 0 dies, rank 0 notices at its collective's timeout, the job timeout; then the same happens.) Every wait has a
timeout (connect, start + load, each job); a job that outlives its timeout kills its replica and is
recorded as failed. Leaving the `with` block (Ctrl-C included) kills every replica, and disconnects
from Ray when this executor connected.

Ray is imported here only, and only when the executor starts.
"""

from __future__ import annotations

import contextlib
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
from mmgen.parallel.launch import init_process
from mmgen.parallel.layout import ParallelConfig, init_layout
from mmgen.progress import NullProgress
from mmgen.render.executors import RenderedJob, load_pipeline, render_job
from mmgen.render.schema import JobSpec, RenderPlan
from pipelines.loader import resolve_device


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
            device_type = resolve_device(self.plan.device).partition(":")[0]
            # Ray shows each rank actor its one GPU as cuda:0: first_device + rank must be 0.
            device = init_process(
                rank, config.world_size, device_type, timeout_s, address, first_device=-rank
            )
            layout = init_layout(config, device)
        self.pipe = load_pipeline(self.plan, parallel=layout)
        return time.perf_counter() - start

    def follow(self, job: JobSpec) -> None:
        """A rank other than 0 of a multi-rank replica: run its part of the job (rank 0 returns it)."""
        with contextlib.suppress(Exception):  # rank 0 meets the same error and returns it
            self.pipe.generate(job.request, progress=False)

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
    parallel: each replica's layout (SP x CFG ranks); with several ranks a replica is that many
    actors in one placement group packed on one node, forming one torch.distributed world (NCCL on
    GPUs, gloo on the CPU); rank 0 returns each job.
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
        parallel: ParallelConfig | None = None,
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
        self.parallel = parallel or ParallelConfig()
        self.actors: dict[str, Any] = {}  # replica name -> its live rank 0 actor
        self.followers: dict[str, list[Any]] = {}  # replica name -> its other ranks' actors
        self.groups: list[Any] = []  # placement groups of multi-rank replicas
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
        ranks = self.parallel.world_size
        for i in range(self.replica_count):
            name = f"mmgen-replica-{self.tag}-{i}"
            # max_concurrency 2: running() answers while render() works; the driver sends one job at a time
            options = {
                "num_cpus": self.num_cpus,
                "num_gpus": self.num_gpus,
                "max_restarts": 0,
                "max_concurrency": 2,
            }
            if ranks == 1:
                self.actors[name] = remote.options(name=name, **options).remote(self.plan, name)
                continue
            bundle = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
            group = ray.util.placement_group([bundle] * ranks, strategy="STRICT_PACK")
            self.groups.append(group)
            self._get([group.ready()], self.timeouts.start, f"placing {ranks} ranks on one node")
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as strategy

            actors = [
                remote.options(
                    name=f"{name}-rank{rank}",
                    scheduling_strategy=strategy(group, placement_group_bundle_index=rank),
                    **options,
                ).remote(self.plan, name)
                for rank in range(ranks)
            ]
            self.actors[name], self.followers[name] = actors[0], actors[1:]
        names = list(self.actors)
        every = [(n, a) for n in names for a in (self.actors[n], *self.followers.get(n, []))]
        where = self._get([a.where.remote() for _, a in every], self.timeouts.start, "start")
        for (name, _), found in zip(every, where, strict=True):
            if found["missing_model"]:
                raise MmgenError(
                    f"node {found['node']} (replica {name}): model directory {found['missing_model']} "
                    "does not exist there; every node needs it at the same path"
                )
            self.where.setdefault(name, found)
        loads = []
        for name in names:
            if ranks == 1:
                loads.append(self.actors[name].load.remote())
                continue
            address = self._get([self.actors[name].address.remote()], self.timeouts.start, "start")[0]
            loads += [
                actor.load.remote(self.parallel, rank, address, self.timeouts.job)
                for rank, actor in enumerate((self.actors[name], *self.followers[name]))
            ]
        self.load_seconds = max(self._get(loads, self.timeouts.start, "model load"))
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
        for name in list(self.actors):
            self._drop(name)
        for group in self.groups:
            with contextlib.suppress(Exception):  # already removed with its cluster
                ray.util.remove_placement_group(group)
        self.groups.clear()
        if self.connected_here:
            ray.shutdown()
            self.connected_here = False

    def _drop(self, name: str) -> None:
        """Kill every rank of one replica (those already gone are skipped)."""
        for actor in (self.actors.pop(name, None), *self.followers.pop(name, [])):
            if actor is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor)

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]:
        """Keep one job in flight per live replica; yield each RenderedJob as it finishes."""
        ray = self.ray
        queue = deque(jobs)
        in_flight: dict[Any, tuple[str, JobSpec, float]] = {}  # object ref -> (replica, job, deadline)
        idle = list(self.actors)
        follow: dict[Any, list[Any]] = {}  # rank 0's ref -> the other ranks' refs of the same job
        while queue or in_flight:
            while queue and idle:
                name = idle.pop(0)
                job = queue.popleft()
                ref = self.actors[name].render.remote(job)
                follow[ref] = [actor.follow.remote(job) for actor in self.followers.get(name, [])]
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
                ray.get(follow.pop(ref, []), timeout=self.timeouts.job)
            except ray.exceptions.RayActorError:  # a rank died mid-job: the job runs again elsewhere
                self._drop(name)
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
                self._drop(name)
                yield _failed(job, f"replica {name} took over {self.timeouts.job:g}s; replica stopped")


def _failed(job: JobSpec, error: str) -> RenderedJob:
    return RenderedJob(job.index, job.label, "ray", error=error)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
