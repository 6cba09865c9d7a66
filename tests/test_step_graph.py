"""CUDA graphs of Qwen-Image-2.1's cached steps (mmgen.models.step_graph) give the eager calls' bits:
one GPU (the whole call one graph) and Ulysses over 2 GPUs (pieces cut at the NCCL exchanges, which run
eagerly between them), also for a later request replaying a kept capture. The CUDA tests run on a GPU host
(benchmarks/gpu_session.sh step_graph_tests); on the CPU the pipeline never captures (every other
Qwen-Image-2.1 test covers that path), and the kept graphs' bookkeeping runs against a stand-in capture
whose replay calls the captured call again on the tensors it captured (what a graph reads)."""

from __future__ import annotations

import pytest
import qwen_image21_parallel_workers as workers
import torch

from mmgen.models.step_graph import GraphSignature, KeptGraph, StepGraph, release_unusable
from mmgen.parallel.collective import run_now
from mmgen.parallel.layout import ParallelConfig


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_replayed_cached_steps_equal_eager_on_one_gpu():
    equal = workers.graph_replays_equal(None)
    assert len(equal) >= 4
    assert [name for name, same in equal.items() if not same] == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_replayed_cached_steps_equal_eager_under_ulysses_on_two_gpus():
    from mmgen.parallel.launch import run_parallel

    equal = run_parallel(workers.graph_replays_equal, ParallelConfig(sp=2), device_type="cuda")
    assert len(equal) >= 4
    assert [name for name, same in equal.items() if not same] == []


EXPECTED_KEPT = {
    "request 0 equals eager": True,
    "request 0 warm-up calls": 1,  # its first cached step eager, the second captured
    "request 0 replays the kept graph": True,  # its capture is the one kept
    "request 1 equals eager": True,  # its own prefix (copied into the kept cache), not request 0's
    "request 1 warm-up calls": 0,  # replayed from its first cached step
    "request 1 replays the kept graph": True,
}


class _ReplayByCall:
    """A CPU stand-in for a captured graph: replay runs the captured call again on what it captured."""

    def __init__(self, call, inputs: tuple, output: torch.Tensor) -> None:
        self.call, self.inputs, self.output = call, inputs, output

    def replay(self) -> None:
        self.output.copy_(self.call(*self.inputs, collective=run_now))


def _capture_by_call(call, *inputs, seams: bool = True) -> StepGraph:
    static = tuple(x.clone() for x in inputs)
    output = call(*static, collective=run_now).clone()
    return StepGraph(static, output, [(_ReplayByCall(call, static, output), None)])


def test_a_later_request_replays_the_kept_capture_with_its_own_cache_on_cpu(monkeypatch):
    monkeypatch.setattr(StepGraph, "capture", staticmethod(_capture_by_call))
    assert workers.kept_graph_requests(None, "cpu") == EXPECTED_KEPT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_later_request_replays_the_kept_capture_on_one_gpu():
    assert workers.kept_graph_requests(None, "cuda") == EXPECTED_KEPT


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_a_later_request_replays_the_kept_capture_under_ulysses_on_two_gpus():
    from mmgen.parallel.launch import run_parallel

    found = run_parallel(workers.kept_graph_requests, ParallelConfig(sp=2), device_type="cuda")
    assert found == EXPECTED_KEPT


def test_kept_graphs_a_request_cannot_replay_are_dropped_before_its_prefill():
    def kept(layout: tuple, loras: tuple) -> KeptGraph:
        return KeptGraph(GraphSignature(layout, loras, ()), graph=None, state=None)

    store = {"both": kept(("a",), (None,)), "half0": kept(("b",), (None,)), "half1": kept(("c",), (None,))}
    # "both" as before, "half0" under another layout, "half1" not in this request (no CFG halves)
    release_unusable(store, {"both": ("a",), "half0": ("x",)}, (None,))
    assert list(store) == ["both"]
    release_unusable(store, {"both": ("a",)}, (("a LoRA",),))  # another LoRA set applied
    assert store == {}
    store = {"both": kept(("a",), (None,))}
    release_unusable(store, {}, (None,))  # a request that replays none (its prefix cache off)
    assert store == {}
