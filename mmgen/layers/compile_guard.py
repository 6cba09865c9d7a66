"""Functions kept out of torch.compile graphs or opaque to it, without importing torch._dynamo in eager code.

`@torch.compiler.disable` imports torch._dynamo (and sympy) as it decorates: ~1 s on a 2-core CPU and
~5 s on a GPU host, paid by every process that imports the module, `mmgen generate`'s request checks
and the `--gpus N` parent included, where nothing is compiled. `@not_compiled` reads
`torch.compiler.is_compiling()` (a flag) per call: in eager code it calls the function; while dynamo
traces, the call goes through `compile_disabled.run_eagerly`, which `torch.compiler.disable`
decorates, so dynamo breaks the graph there and runs the function eagerly, as it runs a decorated one.

`@opaque_op(name)` is torch.library.custom_op for torch.compile only: the first call of a custom op
imports torch._dynamo, sympy and torch.distributed (~830 modules: 1.3 s on a 2-core CPU, ~7 s on a
GPU host whose packages have no cached bytecode), and eager code gains nothing from the dispatcher.
So an eager call goes straight to the function; while dynamo traces, the call is the custom op (one
opaque node with the shapes of its registered fake).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


class OpaqueOp:
    """fn called directly in eager code, and as the custom op `op` while torch.compile traces."""

    def __init__(self, fn: Callable[..., Any], op: Any) -> None:
        self.fn = fn
        self.op = op  # torch._library.custom_ops.CustomOpDef
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: F) -> F:
        """The output shapes the compiled graph sees (as CustomOpDef.register_fake)."""
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.op(*args)
        return self.fn(*args)


def opaque_op(
    name: str, *, mutates_args: tuple[str, ...] = (), device_types: str = "cuda"
) -> Callable[[Callable[..., Any]], OpaqueOp]:
    """Register fn as the custom op `name` ("namespace::op") for compiled graphs; eager calls skip it."""

    def wrap(fn: Callable[..., Any]) -> OpaqueOp:
        op = torch.library.custom_op(name, fn, mutates_args=mutates_args, device_types=device_types)
        return OpaqueOp(fn, op)

    return wrap


def not_compiled(fn: F) -> F:
    """fn, never traced by torch.compile (a graph break around each call); eager calls go straight to fn."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            from mmgen.layers.compile_disabled import run_eagerly  # torch._dynamo is loaded by now

            return run_eagerly(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return call  # type: ignore[return-value]
