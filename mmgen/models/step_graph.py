"""A model call that repeats, captured once as CUDA graphs and replayed: the host's launches leave the step.

Qwen-Image-2.1's cached steps repeat one call: the same shapes, metadata, prefix cache and weights, only
the noise tokens and the timestep change. Eager, every step pays the host's ~40 kernel launches per
layer; under Ulysses each rank's GPU work halves but the host's does not, and every all-to-all makes
the two ranks wait for the slower host. Replaying the call as CUDA graphs removes that cost.

Collectives are the seams. sglang#31852 reports NCCL collectives recorded into a graph through torch's
process groups hanging both ranks at replay, so a call under a parallel layout is captured piecewise:
the code between two collectives is one graph, and each collective runs eagerly between the graphs'
replays, on the buffers the capture kept alive (the send and receive buffers of the exchange: reused
at every step). On torch 2.11 a whole step with its NCCL all-to-alls inside replayed without a hang,
and no faster (63.8 against 63.4 ms; benchmarks/RESULTS.md 20g): the pieces stay, the tested path,
with no collective inside a graph. The model's exchange functions take a `collective` argument for this
(mmgen.parallel.collective): `run_now` (eager, the default) or `PiecewiseCapture.collective` while
recording. One process has no seams: its call is one graph.

Every piece allocates from one private memory pool, in capture order; the pieces replay in that order on
the caller's stream, so a buffer freed by one piece and reused by a later one is never read out of turn.
What stays fixed between replays: the static inputs (each call copies its arguments into them), every
tensor the call reads (weights, cache, metadata: the caller must not replace them) and the call's code
path (no data-dependent branches). Same kernels, same launch order: a replay gives the eager call's bits.

Across requests: a request's capture may be kept (`KeptGraph`, in a store its pipeline owns) with what
its replays read: the request state (e.g. a prefix cache) and the tensors its metadata holds. A later
request whose call has the same signature (shapes, metadata values, code path) copies its own state
into the kept state and replays from its first such call: no eager warm-up, no capture. A call of
another signature drops the kept graph (and its memory pool) before its own capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch

from mmgen.parallel.collective import run_now


class PiecewiseCapture:
    """Records a call as graphs cut at its collectives (see the module docstring). Use through StepGraph."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.pieces: list[tuple[torch.cuda.CUDAGraph, Callable[[], object] | None]] = []
        self._graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread_local: other threads (NCCL's watchdog, the group's heartbeat) may call CUDA meanwhile.
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self, collective: Callable[[], object] | None = None) -> None:
        assert self._graph is not None, "end() without begin()"
        self._graph.capture_end()
        self.pieces.append((self._graph, collective))
        self._graph = None

    def abandon(self) -> None:
        """End a capture the call broke off (its error is the one to report): the stream and the
        allocator leave capture mode, so the process can go on running eagerly."""
        if self._graph is not None:
            graph, self._graph = self._graph, None
            with contextlib.suppress(RuntimeError):  # an invalidated capture raises again on its end
                graph.capture_end()

    def collective(self, fn: Callable[[], object]) -> None:
        """The capturing `collective`: close the piece so far, keep fn to run after its replay, open the next."""
        self.end(fn)
        self.begin()


@dataclass
class StepGraph:
    """One captured call: copy the arguments into `inputs`, replay the pieces, return a copy of `output`."""

    inputs: tuple[torch.Tensor, ...]
    output: torch.Tensor
    pieces: list[tuple[torch.cuda.CUDAGraph, Callable[[], object] | None]]

    @staticmethod
    def capture(call: Callable[..., torch.Tensor], *inputs: torch.Tensor, seams: bool = True) -> StepGraph:
        """Record call(*inputs, collective=...) on a side stream; nothing runs until the first replay. The
        caller has run the call once eagerly before (StepGraphs does), so every kernel is compiled, tuned
        and its workspace made: capture itself runs nothing eagerly. seams=False
        records the collectives inside the one graph (benchmarks/step_graph_collectives.py's question;
        the module docstring has its answer)."""
        static = tuple(x.clone() for x in inputs)
        recorder = PiecewiseCapture()
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            recorder.begin()
            try:
                output = call(*static, collective=recorder.collective if seams else run_now)
            except BaseException:
                recorder.abandon()
                raise
            recorder.end()
        torch.cuda.current_stream().wait_stream(stream)
        return StepGraph(static, output, recorder.pieces)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for static, value in zip(self.inputs, inputs, strict=True):
            if static.shape != value.shape:  # copy_ would broadcast: a replay is of the captured shapes only
                raise ValueError(f"a captured step takes {tuple(static.shape)}, got {tuple(value.shape)}")
            static.copy_(value)
        for graph, collective in self.pieces:
            graph.replay()
            if collective is not None:
                collective()
        return self.output.clone()


class RequestState(Protocol):
    """What a kept graph reads of its request besides the inputs (e.g. a PrefixCache)."""

    def take(self, other: Any) -> None:
        """Copy other's tensors (the same shapes) into this state's own, in place."""


class GraphSignature(NamedTuple):
    """Everything a captured call depends on besides its inputs' values and its request state's values:
    metadata: the values its metadata tensors hold (e.g. BlockCausalLayout.signature); request: what the
    request set that the call reads (the LoRAs applied: weights and modules); call: its inputs' shapes,
    dtypes and devices and the rest of its code path (the attention impl, settings, parallel layout)."""

    metadata: Hashable
    request: Hashable
    call: Hashable

    @staticmethod
    def of(
        metadata: Hashable, request: Hashable, inputs: Sequence[torch.Tensor], *path: Hashable
    ) -> GraphSignature:
        shapes = tuple((tuple(x.shape), x.dtype, str(x.device)) for x in inputs)
        return GraphSignature(metadata, request, (shapes, *path))


def release_unusable(kept: dict[str, KeptGraph], usable: dict[str, Hashable], request: Hashable) -> None:
    """Drop the kept graphs a request cannot replay (usable: its keys' metadata signatures; a key it has
    not, other metadata, another request part) before its first call, so their memory pools and state
    are not held through its work."""
    for key, graph in list(kept.items()):
        signature = graph.signature
        if key not in usable or signature.metadata != usable[key] or signature.request != request:
            del kept[key]


@dataclass(frozen=True)
class KeptGraph:
    """A captured call kept for later requests: its signature, the graph, the request state it reads
    (a later request's is copied into it) and everything else whose tensors its replays read (kept
    alive: freed, their memory could be reused under the graph)."""

    signature: GraphSignature
    graph: StepGraph
    state: RequestState
    reads: tuple[Any, ...] = ()


@dataclass
class StepGraphs:
    """A request's captured calls, one per key (e.g. a CFG branch): the key's first call runs eagerly
    (the warm-up), its second is captured and replayed, every later one replayed. Request state, made
    per request by the caller (like the prefix caches whose tensors the graphs read). With `kept` (a
    store its pipeline owns, one graph per key) a call given a signature first looks there: the same
    signature takes the kept graph (this request's state copied into the kept one) from its first call
    on; another drops it; and a capture is kept there, with its state and reads. The signature is a
    function, called only at a key's first lookup (not at every replay)."""

    graphs: dict[str, StepGraph] = field(default_factory=dict)
    warmed: set[str] = field(default_factory=set)
    kept: dict[str, KeptGraph] | None = None

    def __call__(
        self,
        key: str,
        call: Callable[..., torch.Tensor],
        *inputs: torch.Tensor,
        signature: Callable[[], GraphSignature] | None = None,
        state: RequestState | None = None,
        reads: tuple[Any, ...] = (),
    ) -> torch.Tensor:
        graph = self.graphs.get(key)
        if graph is not None:
            return graph(*inputs)
        keeping = self.kept is not None and signature is not None and state is not None
        made = signature() if keeping else None
        if keeping and (graph := self._adopt(key, made, state)) is not None:
            return graph(*inputs)
        if key not in self.warmed:
            self.warmed.add(key)
            return call(*inputs, collective=run_now)
        graph = self.graphs[key] = StepGraph.capture(call, *inputs)
        if keeping:
            self.kept[key] = KeptGraph(made, graph, state, reads)
        return graph(*inputs)

    def _adopt(self, key: str, signature: GraphSignature, state: RequestState) -> StepGraph | None:
        """The kept graph of `key` when its signature is this one (state copied into its state), else
        None, the kept graph dropped (its pool freed before this request's own warm-up and capture)."""
        kept = self.kept.get(key)
        if kept is None:
            return None
        if kept.signature != signature:
            del self.kept[key]
            return None
        kept.state.take(state)
        self.graphs[key] = kept.graph
        return kept.graph

    @property
    def captured(self) -> int:
        return len(self.graphs)
