"""Which free replica takes which job: the one that already holds the job's LoRA set, when one is free.

A replica keeps the LoRAs of its last job applied (pipelines' LoRASlot: an unchanged set is kept,
any other set - none included - restores the base weights first and reads the new files), and its
experts where its last job placed them (offload, GPU budget: moved only when these change).
Loading a set costs seconds on a 14B model, so a job goes to a free replica whose last job had the
same set (the same files, strengths, experts - Wan2.2's high/low-noise transformers - and mode,
and the same placement). When none is free the job still runs now, on a free replica on the base
weights if there is one (it gives up no loaded set), else the first free one. (A free replica
holding a set some waiting job wants has taken that job in the first pass.) Nothing waits for a
busy replica: an idle replica costs more than a LoRA load.

Pure bookkeeping (no Ray, no processes), so the policy is tested on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from pipelines.request import GenerationRequest

Job = TypeVar("Job")
# What every replica holds after its model loads: no LoRA, the weights where the load put them.
BASE: Hashable = ((), (None, None))


def lora_set(request: GenerationRequest) -> Hashable:
    """What a replica must hold to run `request` without loading or moving weights: its LoRA files
    (path, pinned sha256), strengths, experts and mode, and where its experts live (the request's
    offload and GPU budget: a pipeline moves weights only when these change between calls).
    BASE for a request with neither."""
    placement = (request.offload, request.gpu_memory_gb)
    if not request.lora:
        return ((), placement)
    files = tuple((str(r.path), r.sha256, r.strength, r.experts) for r in request.lora)
    return ((files, request.lora_mode, request.lora_allow_unmatched), placement)


class AffinityScheduler:
    """Remembers the set each replica holds and pairs waiting jobs with free replicas (module docstring)."""

    def __init__(self) -> None:
        self._holds: dict[str, Hashable] = {}

    def holds(self, replica: str) -> Hashable:
        """The set `replica` holds now (BASE until it ran a job with LoRAs)."""
        return self._holds.get(replica, BASE)

    def forget(self, replica: str) -> None:
        """`replica` is gone (or restarted on the base weights)."""
        self._holds.pop(replica, None)

    def assign(
        self, waiting: Sequence[Job], free: Sequence[str], key: Callable[[Job], Hashable]
    ) -> list[tuple[str, Job]]:
        """(replica, job) pairs for as many waiting jobs as there are free replicas; each pair is
        recorded (the replica holds the job's set from now on). Jobs keep their order within each pass."""
        free, waiting = list(free), list(waiting)
        pairs = []
        for job in list(waiting):  # first pass: a free replica that holds the job's set already
            if not free:
                break
            match = next((r for r in free if self.holds(r) == key(job)), None)
            if match is not None:
                pairs.append((match, job))
                free.remove(match)
                waiting.remove(job)
        for job in waiting[: len(free)]:  # then: one on the base weights (nothing to give up) first
            replica = min(free, key=lambda r: self.holds(r) != BASE)
            pairs.append((replica, job))
            free.remove(replica)
        for replica, job in pairs:
            self._holds[replica] = key(job)
        return pairs
