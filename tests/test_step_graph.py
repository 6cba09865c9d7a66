"""CUDA graphs of Qwen-Image-2.1's cached steps (mmgen.models.step_graph) give the eager calls' bits:
one GPU (the whole call one graph) and Ulysses over 2 GPUs (pieces cut at the NCCL exchanges, which run
eagerly between them). CUDA only: on the CPU every step runs eagerly (the pipeline never captures there),
which every other Qwen-Image-2.1 test covers; run on a GPU host (benchmarks/gpu_session.sh step_graph_tests)."""

from __future__ import annotations

import pytest
import qwen_image21_parallel_workers as workers
import torch

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
