"""The one `torch.compiler.disable` of mmgen.layers.compile_guard, imported only while dynamo traces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


@torch.compiler.disable
def run_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) outside any compiled graph (dynamo breaks the graph at this call)."""
    return fn(*args, **kwargs)
