"""Functions kept out of torch.compile graphs, without importing torch._dynamo when their module loads.

`@torch.compiler.disable` imports torch._dynamo (and sympy) as it decorates: ~1 s on a 2-core CPU and
~5 s on a GPU host, paid by every process that imports the module, `mmgen generate`'s request checks
and the `--gpus N` parent included, where nothing is compiled. `@not_compiled` reads
`torch.compiler.is_compiling()` (a flag) per call: in eager code it calls the function; while dynamo
traces, the call goes through `compile_disabled.run_eagerly`, which `torch.compiler.disable`
decorates, so dynamo breaks the graph there and runs the function eagerly, as it runs a decorated one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def not_compiled(fn: F) -> F:
    """fn, never traced by torch.compile (a graph break around each call); eager calls go straight to fn."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            from mmgen.layers.compile_disabled import run_eagerly  # torch._dynamo is loaded by now

            return run_eagerly(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
