"""Qwen-Image-2.1's cached steps as CUDA graphs (mmgen.models.step_graph), apart from its family file:
whether they apply, a request's graphs over the pipeline's kept store, and one cached call through them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmgen.models.step_graph import GraphSignature, StepGraphs, release_unusable


def step_graphs(pipeline: Any) -> bool:
    """Whether cached steps replay as CUDA graphs: asked for (the default), on CUDA, and the weights
    resident (offload streams or moves them between steps: a graph would read stale addresses)."""
    return pipeline.cuda_graphs and pipeline.device.type == "cuda" and pipeline.offload == "none"


def request_graphs(pipeline: Any, cached: bool, branches: Sequence[Any]) -> tuple[StepGraphs | None, tuple]:
    """A request's StepGraphs over the pipeline's kept graphs (None: its steps run eagerly) and its part
    of their signature (the LoRAs applied: the weights and modules a call reads). Kept graphs it cannot
    replay (a branch it has not, another layout or LoRA set; every one without graphs) are dropped
    now, before its prefill, so their memory pools and caches are not held through its work."""
    request = (pipeline.loras.applied,)
    graphs = StepGraphs(kept=pipeline.kept_graphs) if cached and step_graphs(pipeline) else None
    usable = {branch.key: branch.layout.signature for branch in branches} if graphs is not None else {}
    release_unusable(pipeline.kept_graphs, usable, request)
    return graphs, request


def replayed_call(
    graphs: StepGraphs,
    branch: Any,
    request: tuple,
    models: Any,
    forward: Callable[..., torch.Tensor],
    cache: Any,
    tokens: torch.Tensor,
    timestep: torch.Tensor,
) -> torch.Tensor:
    """A cached call of `branch` (a Branch21) through the request's graphs: eager, captured, replayed,
    or a kept capture's replay (its prefix cache taken into the kept one) when the signature matches."""

    def signature() -> GraphSignature:  # made at the branch's first lookup only, not at every replay
        impl = models.attention
        path = (
            type(impl).__name__,
            getattr(impl, "provider", None),
            models.settings,
            models.layout.describe(),
        )
        return GraphSignature.of(branch.layout.signature, request, (tokens, timestep), *path)

    return graphs(
        branch.key, forward, tokens, timestep, signature=signature, state=cache, reads=(branch.layout,)
    )
