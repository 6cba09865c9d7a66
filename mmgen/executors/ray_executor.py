"""Ray replicas for `mmgen render FILE --ray ...` and `mmgen serve --ray ...` (the `ray` extra).

Each replica holds one loaded pipeline between jobs: one Ray actor, or with several ranks (SP x CFG)
that many actors in one placement group packed on one node, forming one torch.distributed world
(NCCL on GPUs, gloo on the CPU) as a local render group does; rank 0 returns each job. The
driver keeps one job in flight per replica. Waiting jobs go to free replicas through an
AffinityScheduler (scheduling.py): a job goes to a free replica that already holds its
LoRA set. A replica returns the job's frames and identity through Ray's object store; the driver
alone writes outputs and records (render's runner, or the server's worker), so no shared
filesystem is needed.

Two ways to drive it: `run(jobs)` (a render: every job known up front) or, for a server whose
jobs arrive over time, `submit(job)` / `step(timeout)` (the finished jobs) / `capacity()` (free
replicas no waiting job has taken) / `stop_job(index)` (stop a running job between its steps) /
`job_progress(index)` / `alive()`. `run` is written on those.

What each node needs: mmgen installed (the same version) and the model directory at the same path
(the embedded default model is built where it is missing), LoRA files at the paths jobs name.
Before the first job every replica checks that the model directory exists on its node; one that
lacks it stops the executor with one line naming the node.

Faults: a replica that dies mid-job (its process killed, its node lost; for a multi-rank replica,
any of its ranks) is dropped whole - every rank killed, its placement group removed - a replacement
is started (all its ranks, in a new placement group; up to `restarts` times per replica slot) and
its job goes back to the front of the queue: it runs once more and is recorded once, when it
finishes; lost a second time, it is recorded as failed. Every wait has a timeout (connect, start +
load, each job); a job that outlives its timeout is recorded as failed (the error names the
timeout) and its replica, which may be what hangs, is killed and replaced the same way (the job is
not run again). Leaving the `with` block (Ctrl-C included) kills every replica, and disconnects
from Ray when this executor connected.

A server checks requests before queueing them with `check_request`: a loaded replica runs its
pipeline's own check (any model family) and answers at once, even while it renders.

The actors' side (a loaded pipeline, its jobs, its stop flag) is ray_replica.py. Ray is
imported by these two modules only, and only when the executor starts.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from mmgen.errors import MmgenError, ValidationError
from mmgen.executors.jobs import JobSpec, ModelSpec, RenderedJob, ReplicaUnavailable
from mmgen.executors.ray_cluster import check_fit, cluster_address, device_of, probe
from mmgen.executors.ray_replica import Replica
from mmgen.executors.scheduling import AffinityScheduler, lora_set
from mmgen.parallel.layout import ParallelConfig
from pipelines.request import GenerationRequest

JOB_ATTEMPTS = 2  # a job whose replica is lost under it runs once more; lost again, it fails
PROGRESS_TIMEOUT_S = 10.0  # a replica answers progress() while it renders (max_concurrency 2)
CHECK_TIMEOUT_S = 10.0  # ... and check_request() too


@dataclass(frozen=True)
class RayTimeouts:
    """Seconds each wait may take: a replica's start and model load, one job. (Connecting is bounded
    by Ray's own connect timeout.)"""

    start: float = 600.0
    job: float = 3600.0


@dataclass(frozen=True)
class Flight:
    """One job in flight on a replica: rank 0's call (it returns the job), the other ranks' calls
    not yet finished, and the job's deadline."""

    job: JobSpec
    deadline: float
    result: Any
    followers: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Starting:
    """A replacement loading: every rank's load call (rank 0's first) and its deadline."""

    loads: tuple[Any, ...]
    deadline: float


class RayExecutor:
    """`replicas` Ray replicas, each with its own pipeline; see the module docstring.

    address: 'auto' (a running cluster: `ray start --head` on this machine or RAY_ADDRESS), or a
    cluster address 'HOST:PORT' / 'ray://HOST:PORT'; one that does not answer is one line within
    seconds (ray_cluster.py). When Ray is already initialized in this process (a test's local
    cluster) that connection is used and left open. The spec's device 'auto' is resolved for the
    cluster (cuda when a node has a GPU, else cpu), and the cluster is checked to hold every replica
    before any is placed.
    runtime_env: handed to ray.init when this executor connects (e.g. env_vars for the workers).
    num_cpus / num_gpus: what each rank of a replica asks of Ray (default 1 CPU; 1 GPU when the
    device, resolved for the cluster, is not 'cpu').
    log: told of replacements, and each replica's node, jobs, busy seconds and LoRA loads at close.
    parallel: each replica's layout (SP x CFG ranks); with several ranks a replica is that many
    actors in one placement group packed on one node, forming one torch.distributed world (NCCL on
    GPUs, gloo on the CPU); rank 0 returns each job.
    restarts: replacements started per replica slot, for ones lost or stopped at a job's timeout.
    """

    def __init__(
        self,
        spec: ModelSpec,
        *,
        address: str = "auto",
        replicas: int = 1,
        timeouts: RayTimeouts | None = None,
        runtime_env: dict[str, Any] | None = None,
        num_cpus: float = 1.0,
        num_gpus: float | None = None,
        log: Callable[[str], None] | None = None,
        parallel: ParallelConfig | None = None,
        restarts: int = 2,
    ):
        if replicas < 1:
            raise MmgenError(f"--replicas {replicas}: need at least 1")
        self.spec = spec
        self.address = address
        self.replica_count = replicas
        self.timeouts = timeouts or RayTimeouts()
        self.runtime_env = runtime_env
        self.num_cpus = num_cpus
        self.asked_gpus = num_gpus
        self.num_gpus = 0.0  # set at start, once the device is resolved for the cluster
        self.tag = uuid.uuid4().hex[:8]
        self.load_seconds = 0.0
        self.parallel = parallel or ParallelConfig()
        self.restarts = restarts
        self.actors: dict[str, Any] = {}  # replica name -> its live rank 0 actor
        self.followers: dict[str, list[Any]] = {}  # replica name -> its other ranks' actors
        self.groups: dict[str, Any] = {}  # replica name -> placement group (multi-rank replicas)
        self.where: dict[str, dict[str, Any]] = {}  # replica name -> its node, pid
        self.busy_seconds: dict[str, float] = {}  # replica name -> seconds spent rendering
        self.jobs_done: dict[str, int] = {}  # replica name -> jobs it returned
        self.lora_loads: dict[str, int] = {}  # replica name -> LoRA sets it read and applied
        self.scheduler = AffinityScheduler()
        self.queue: deque[JobSpec] = deque()  # submitted, not yet on a replica
        self.keys: dict[int, Any] = {}  # job index -> the set it needs (scheduling.lora_set), computed once
        self.free: list[str] = []  # loaded replicas without a job
        # Loaded replicas' (name, rank 0 actor): rebound, never changed in place, as check_request
        # reads it from another thread (a server's HTTP side).
        self.loaded: tuple[tuple[str, Any], ...] = ()
        self.in_flight: dict[str, Flight] = {}  # replica name -> the job it runs
        self.starting: dict[str, Starting] = {}  # replacement name -> its loads
        self.slot: dict[str, int] = {}  # replica name -> its slot (a replacement takes the lost one's)
        self.restarted: Counter[int] = Counter()  # slot -> replacements started
        self.lost: Counter[int] = Counter()  # job index -> times its replica was lost under it
        self.log = log
        self.connected_here = False
        self.ray: Any = None

    # -- lifetime --

    def __enter__(self) -> RayExecutor:
        try:
            import ray
        except ImportError:
            raise MmgenError('--ray needs the ray extra: pip install "mmgen[ray]"') from None
        self.ray = ray
        if not ray.is_initialized():
            self._connect()
        try:
            self._fit_cluster()
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
            for name, usage in self.usage().items():
                self.log(
                    f"{name} on {usage['node']}: {usage['jobs']} jobs, busy {usage['busy_s']:.2f}s, "
                    f"{usage['lora_loads']} LoRA loads"
                )

    def usage(self) -> dict[str, dict[str, Any]]:
        """Per replica (lost ones included): node, jobs returned, seconds rendering, LoRA sets loaded."""
        return {
            name: {
                "node": self.where.get(name, {}).get("node", "?"),
                "jobs": self.jobs_done[name],
                "busy_s": busy,
                "lora_loads": self.lora_loads[name],
            }
            for name, busy in self.busy_seconds.items()
        }

    def _connect(self) -> None:
        ray = self.ray
        address, source = cluster_address(self.address)
        probe(address, source)  # one line within seconds, not minutes of Ray's own retries
        try:
            ray.init(
                address=address,
                runtime_env=self.runtime_env,
                include_dashboard=False,
                log_to_driver=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise MmgenError(
                f"--ray {self.address}: cannot connect to a Ray cluster ({_first_line(err)})"
            ) from None
        self.connected_here = True

    def _fit_cluster(self) -> None:
        """Resolve the device for the cluster and check it can hold every replica (ray_cluster.py)."""
        nodes = [node["Resources"] for node in self.ray.nodes() if node.get("Alive")]
        device = device_of(self.spec.device, nodes)
        self.spec = replace(self.spec, device=device)
        gpus = self.asked_gpus
        self.num_gpus = (0.0 if device == "cpu" else 1.0) if gpus is None else gpus
        check_fit(nodes, self.replica_count, self.parallel.world_size, self.num_cpus, self.num_gpus)

    def _actor(self, name: str, replica: str, **options: Any) -> Any:
        """Actor `name`, one rank of `replica` (the name its jobs' records carry)."""
        # max_concurrency 2: running()/progress()/stop_job()/check_request() answer while render()
        # works; the driver sends one job at a time
        remote = self.ray.remote(Replica)
        resources = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_restarts": 0}
        return remote.options(name=name, max_concurrency=2, **resources, **options).remote(self.spec, replica)

    def _start_replicas(self) -> None:
        """Start every replica, check its node has the model, then load the pipelines (all bounded)."""
        names = [f"mmgen-replica-{self.tag}-{i}" for i in range(self.replica_count)]
        placed = []
        for i, name in enumerate(names):
            self.slot[name] = i
            placed += self._spawn(name)
        if placed:
            ranks = self.parallel.world_size
            self._get(placed, self.timeouts.start, f"placing {ranks} ranks on one node")
        every = [(n, a) for n in names for a in (self.actors[n], *self.followers.get(n, []))]
        where = self._get([a.where.remote() for _, a in every], self.timeouts.start, "start")
        for (name, _), found in zip(every, where, strict=True):
            if found["missing_model"]:
                raise MmgenError(
                    f"node {found['node']} (replica {name}): model directory {found['missing_model']} "
                    "does not exist there; every node needs it at the same path"
                )
            self.where.setdefault(name, found)
        loads = [ref for name in names for ref in self._load(name)]
        self.load_seconds = max(self._get(loads, self.timeouts.start, "model load"))
        for name in names:
            self._add_replica(name)

    def _spawn(self, name: str) -> list[Any]:
        """Create replica `name`'s actors, every rank; several ranks go into a new placement group
        packed on one node. Returns the group's ready ref ([] for one rank); nothing is awaited."""
        ranks = self.parallel.world_size
        if ranks == 1:
            self.actors[name] = self._actor(name, name)
            return []
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy as strategy

        bundle = {"CPU": self.num_cpus, **({"GPU": self.num_gpus} if self.num_gpus else {})}
        group = self.ray.util.placement_group([bundle] * ranks, strategy="STRICT_PACK")
        self.groups[name] = group
        actors = [
            self._actor(
                f"{name}-rank{rank}",
                name,
                scheduling_strategy=strategy(group, placement_group_bundle_index=rank),
            )
            for rank in range(ranks)
        ]
        self.actors[name], self.followers[name] = actors[0], actors[1:]
        return [group.ready()]

    def _load(self, name: str) -> list[Any]:
        """Every rank's load call, rank 0's first. Several ranks join one torch.distributed world at
        rank 0's address: its ref is handed to the calls (Ray resolves it), so nothing is awaited."""
        ranks = (self.actors[name], *self.followers.get(name, []))
        if len(ranks) == 1:
            return [ranks[0].load.remote()]
        address = ranks[0].address.remote()
        return [
            actor.load.remote(self.parallel, rank, address, self.timeouts.job)
            for rank, actor in enumerate(ranks)
        ]

    def _add_replica(self, name: str) -> None:
        self.busy_seconds[name], self.jobs_done[name], self.lora_loads[name] = 0.0, 0, 0
        self.free.append(name)
        self.loaded = (*self.loaded, (name, self.actors[name]))

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
        for name in {*self.actors, *self.groups}:
            self._drop(name)
        if self.connected_here:
            ray.shutdown()
            self.connected_here = False

    def _drop(self, name: str) -> None:
        """Kill every rank of one replica (those already gone are skipped) and remove its placement group."""
        self.loaded = tuple(pair for pair in self.loaded if pair[0] != name)
        for actor in (self.actors.pop(name, None), *self.followers.pop(name, [])):
            if actor is not None:
                with contextlib.suppress(Exception):
                    self.ray.kill(actor)
        group = self.groups.pop(name, None)
        if group is not None:
            with contextlib.suppress(Exception):  # already removed with its cluster
                self.ray.util.remove_placement_group(group)
        if name in self.free:
            self.free.remove(name)
        self.scheduler.forget(name)

    # -- jobs --

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]:
        """Every job on the replicas; yield each RenderedJob as it finishes."""
        for job in jobs:
            self.submit(job)
        while self.queue or self.in_flight:
            yield from self.step(self.timeouts.job)

    def submit(self, job: JobSpec) -> None:
        """Queue `job`: it goes to a replica at the next step()."""
        self.keys[job.index] = lora_set(job.request)
        self.queue.append(job)

    def alive(self) -> int:
        """Replicas alive or starting (0: no job will run again)."""
        return len(self.actors)

    def capacity(self) -> int:
        """Free replicas that no queued job will take at the next step()."""
        return max(0, len(self.free) - len(self.queue))

    def step(self, timeout: float) -> list[RenderedJob]:
        """Hand queued jobs to free replicas, wait (at most `timeout` seconds) for one event, and
        return the jobs that ended with it (a lost replica's job goes back to the queue instead)."""
        ended = self._step(timeout)
        for rendered in ended:
            self.keys.pop(rendered.index, None)
        return ended

    def _step(self, timeout: float) -> list[RenderedJob]:
        self._dispatch()
        if self.queue and not (self.free or self.in_flight or self.starting):
            failed = [_failed(job, "no Ray replica left alive") for job in self.queue]
            self.queue.clear()
            return failed
        # Every rank's call is watched: a rank other than 0 that dies ends its replica's job now,
        # not when rank 0's collective times out.
        waits = {flight.result: ("result", name) for name, flight in self.in_flight.items()}
        waits |= {ref: ("rank", name) for name, f in self.in_flight.items() for ref in f.followers}
        waits |= {start.loads[0]: ("load", name) for name, start in self.starting.items()}
        if not waits:
            return []
        deadlines = [f.deadline for f in self.in_flight.values()]
        deadline = min(deadlines + [start.deadline for start in self.starting.values()])
        wait = max(0.0, min(timeout, deadline - time.monotonic()))
        ready, _ = self.ray.wait(list(waits), num_returns=1, timeout=wait)
        if not ready:
            return list(self._expire())
        kind, name = waits[ready[0]]
        if kind == "load":
            self._started(name)
            return []
        if kind == "rank":
            return self._followed(name, ready[0])
        return self._finished(name)

    def stop_job(self, index: int) -> bool:
        """Stop job `index`: a queued one leaves the queue (True); a running one stops at its next
        progress report and comes back from step() as failed (False)."""
        for job in self.queue:
            if job.index == index:
                self.queue.remove(job)
                self.keys.pop(index, None)
                return True
        for name, flight in self.in_flight.items():
            if flight.job.index == index:
                self.actors[name].stop_job.remote(index)
        return False

    def job_progress(self, index: int) -> tuple[str, int, int] | None:
        """(stage, units done, units in the stage) of running job `index`; None if not running."""
        for name, flight in self.in_flight.items():
            if flight.job.index == index:
                try:
                    found = self.ray.get(self.actors[name].progress.remote(), timeout=PROGRESS_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - a replica dying now: step() handles it
                    return None
                return tuple(found[1:]) if found[0] == index else None
        return None

    def describe(self) -> dict[str, Any]:
        """The model facts of a loaded replica (Replica.describe), bounded by the start timeout."""
        name, actor = self.loaded[0]
        return self._get([actor.describe.remote()], self.timeouts.start, f"describe ({name})")[0]

    def check_request(self, request: GenerationRequest) -> GenerationRequest:
        """The served pipeline's own check_request(request), run by a loaded replica (it answers
        while it renders): the request with the model's defaults filled in, or ValidationError with
        the pipeline's message. ReplicaUnavailable when no loaded replica answers in
        CHECK_TIMEOUT_S. Safe to call from another thread than step()'s: it reads `loaded` once."""
        ray = self.ray
        for name, actor in self.loaded:
            try:
                checked, refusal = ray.get(actor.check_request.remote(request), timeout=CHECK_TIMEOUT_S)
            except ray.exceptions.RayActorError:  # lost since: the next one answers
                continue
            except ray.exceptions.GetTimeoutError:
                raise ReplicaUnavailable(
                    f"Ray replica {name} did not check the request in {CHECK_TIMEOUT_S:g}s"
                ) from None
            if checked is None:
                raise ValidationError(refusal)
            return checked
        raise ReplicaUnavailable("no loaded Ray replica to check the request")

    def _dispatch(self) -> None:
        pairs = self.scheduler.assign(list(self.queue), self.free, lambda job: self.keys[job.index])
        taken = {id(job) for _, job in pairs}
        self.queue = deque(job for job in self.queue if id(job) not in taken)
        for name, job in pairs:
            self.free.remove(name)
            result = self.actors[name].render.remote(job)
            followers = tuple(actor.follow.remote(job) for actor in self.followers.get(name, []))
            self.in_flight[name] = Flight(job, time.monotonic() + self.timeouts.job, result, followers)

    def _finished(self, name: str) -> list[RenderedJob]:
        """Rank 0 of `name` returned its job (or died)."""
        ray = self.ray
        flight = self.in_flight.pop(name)
        job = flight.job
        try:
            rendered = ray.get(flight.result, timeout=self.timeouts.job)
            ray.get(list(flight.followers), timeout=self.timeouts.job)
        except ray.exceptions.RayActorError:  # a rank died mid-job: the job runs again elsewhere
            return self._lost(name, job)
        except ray.exceptions.RayTaskError as err:
            self.free.append(name)
            return [_failed(job, f"replica {name}: {_first_line(err)}")]
        self.busy_seconds[name] += float(rendered.timings.get("render", 0.0))
        self.jobs_done[name] += 1
        self.lora_loads[name] += rendered.lora_loads
        self.free.append(name)
        return [rendered]

    def _followed(self, name: str, ref: Any) -> list[RenderedJob]:
        """A rank other than 0 of `name` ended its part of the job: fine, or it died (the replica is lost)."""
        flight = self.in_flight[name]
        try:
            self.ray.get(ref, timeout=self.timeouts.job)  # ready: returns or raises at once
        except self.ray.exceptions.RayActorError:
            del self.in_flight[name]
            return self._lost(name, flight.job)
        except self.ray.exceptions.RayTaskError:  # rank 0 meets the same error and returns it
            pass
        followers = tuple(other for other in flight.followers if other != ref)
        self.in_flight[name] = replace(flight, followers=followers)
        return []

    def _lost(self, name: str, job: JobSpec) -> list[RenderedJob]:
        """`name` died under `job`: replace it; the job runs again, or fails when lost twice."""
        self._drop(name)
        self._replace(name, "lost")
        self.lost[job.index] += 1
        if self.lost[job.index] >= JOB_ATTEMPTS:
            return [_failed(job, f"its replica was lost under it {JOB_ATTEMPTS} times ({name} last)")]
        self.queue.appendleft(job)
        return []

    def _replace(self, gone: str, why: str) -> bool:
        """Start a replacement for the dropped replica `gone`, every rank (its load is awaited in
        step()); False when its slot has used up its restarts."""
        slot = self.slot[gone]
        if self.restarted[slot] >= self.restarts:
            self._say(f"{gone} {why}; not replaced ({self.restarted[slot]} replacements so far)")
            return False
        self.restarted[slot] += 1
        name = f"mmgen-replica-{self.tag}-{slot}r{self.restarted[slot]}"
        self.slot[name] = slot
        self._spawn(name)  # a new placement group is awaited through the loads' deadline
        loads = tuple(self._load(name))
        self.starting[name] = Starting(loads, time.monotonic() + self.timeouts.start)
        self._say(f"{gone} {why}; starting {name} in its place")
        return True

    def _started(self, name: str) -> None:
        """Rank 0 of replacement `name` loaded (or failed to): it takes jobs once every rank has."""
        ray = self.ray
        start = self.starting.pop(name)
        try:
            ray.get(list(start.loads), timeout=max(1.0, start.deadline - time.monotonic()))
            self.where[name] = ray.get(self.actors[name].where.remote(), timeout=self.timeouts.start)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.RayTaskError,
            ray.exceptions.GetTimeoutError,
        ) as err:
            self._say(f"{name} failed to start ({_first_line(err)}); not replaced")
            self._drop(name)
            return
        self._add_replica(name)

    def _expire(self) -> Iterator[RenderedJob]:
        """Fail every job past its deadline and replace its replica (it may be stuck for good: it
        is killed); drop replacements that did not load in time."""
        now = time.monotonic()
        limit = f"{self.timeouts.job:g}s"
        for name, flight in list(self.in_flight.items()):
            if flight.deadline <= now:
                del self.in_flight[name]
                self._drop(name)
                replaced = self._replace(name, f"stopped: its job took over the {limit} job timeout")
                then = "stopped and replaced" if replaced else "stopped (no replacement left)"
                yield _failed(
                    flight.job, f"took over the {limit} job timeout on replica {name}; replica {then}"
                )
        for name, start in list(self.starting.items()):
            if start.deadline <= now:
                del self.starting[name]
                self._say(f"{name} did not load in {self.timeouts.start:g}s; stopped")
                self._drop(name)

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)


def _failed(job: JobSpec, error: str) -> RenderedJob:
    return RenderedJob(job.index, job.label, "ray", error=error)


def _first_line(err: BaseException) -> str:
    """The first line only (not mmgen.errors.one_line's whole message): a Ray task error's text carries
    the remote traceback after it."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
