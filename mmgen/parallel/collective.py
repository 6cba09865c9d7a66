"""How a model call's collectives run: now (eager), or recorded as the seams of a piecewise CUDA graph
capture (mmgen.models.step_graph). The exchange functions take one `collective` argument and hand it a
function that enqueues the collective on buffers they allocated before; `run_now` calls it at once."""

from __future__ import annotations

from collections.abc import Callable

Collective = Callable[[Callable[[], object]], None]


def run_now(fn: Callable[[], object]) -> None:
    """The eager `collective`: enqueue the collective where the code stands."""
    fn()
