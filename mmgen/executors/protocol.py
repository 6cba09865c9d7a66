"""Where jobs run, as a value: an executor takes jobs and gives back what each produced.

An executor is a context manager (entering it starts its replicas and loads their pipelines) with
`run(jobs) -> Iterator[RenderedJob]` (one RenderedJob per job, in the order they finish) and
`load_seconds` (the slowest replica's model load, 0 before it loaded). It never writes: its client
(render's runner, the server's worker, `mmgen generate`) writes each job's outputs through the atomic
writers and records it, so a job is recorded once wherever it ran.

InProcessExecutor   one pipeline in this process
LocalGroupsExecutor groups.py: local torch.distributed worlds of spawned processes (--gpus/--sp)
RayExecutor         ray_executor.py: Ray actors (ray_replica.py), one loaded pipeline each (the `ray` extra)

A RenderedJob carries the raw uint8 frames, not encoded files: the client encodes them with the same
writers a one-process run uses, so the bytes on disk cannot depend on where a job ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Protocol

from mmgen.executors.jobs import JobSpec, RenderedJob


class Pipeline(Protocol):
    """A loaded pipeline of any family (Wan, Qwen-Image): one request in, a GenerationResult out."""

    def generate(self, request: Any, *, progress: Any = ...) -> Any: ...


PipelineLoader = Callable[[], Pipeline]  # loads the one pipeline an InProcessExecutor runs


class Executor(Protocol):
    """Runs jobs and yields what each produced (see the module docstring)."""

    load_seconds: float

    def run(self, jobs: Sequence[JobSpec]) -> Iterator[RenderedJob]: ...

    def __enter__(self) -> Executor: ...

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None
    ) -> None: ...
