"""Qwen-Image-2.1 on several processes (CPU, gloo, forked worlds of 2 and 4 as tests/test_parallel.py):
Ulysses over the packed block-causal rows, CFG parallel, CFG 2 x Ulysses 2, each against one process,
text-to-image and an edit with a condition image, with the prefix KV cache on (the prefill that fills
it and a cached step that reads it).
"""

from __future__ import annotations

import parallel_workers
import pytest
import qwen_image21_parallel_workers as workers
import torch

from mmgen.errors import ValidationError
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Transformer
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from mmgen.parallel.layout import ParallelConfig, ParallelLayout

# Max abs difference from one process, as tests/test_parallel.py: each rank runs the same math on
# other shapes (the per-token GEMMs on a shard of the rows, attention on all rows of fewer heads), so
# the difference is fp32 rounding of a few ulps per op, by the BLAS kernel a CPU picks per shape.
# Outputs here are O(1); measured 0.0 (one thread, AMD EPYC); a wrong shard, head order, RoPE row or
# cache row moves them by 1e-3 and more (RoPE rows shifted by one on the shards: 7e-3).
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_errors(request) -> tuple[int, dict[str, float]]:
    return request.param, parallel_workers.run_forked(workers.everything, ParallelConfig(sp=request.param))


def _failing(errors: dict[str, float], prefix: str, tolerance: float = TOLERANCE) -> dict[str, float]:
    picked = {name: err for name, err in errors.items() if name.startswith(prefix)}
    assert picked, f"no results named {prefix!r}: {sorted(errors)}"
    return {name: err for name, err in picked.items() if not err <= tolerance}


def test_ulysses_equals_one_process_with_the_prefix_cache(world_errors):
    """8 heads over Ulysses 2 and 4 (4 and 2 heads a rank); 35 / 41 / 24 packed rows (padded)."""
    world, errors = world_errors
    assert _failing(errors, f"ulysses{world}/") == {}
    for variant in ("t2i", "edit"):
        for kernels in ("off", "on"):
            for impl in ("sdpa", "reference"):
                for step in ("prefill", "cached", "uncached"):
                    assert f"ulysses{world}/{variant}/kernels-{kernels}/{impl}/{step}" in errors


def test_cfg_parallel_equals_one_process(world_errors):
    world, errors = world_errors
    sp = world // 2
    # uncond + s * (cond - uncond) carries each branch's rounding amplified by up to 1 + 2s
    assert _failing(errors, f"cfg2 x sp{sp}/", TOLERANCE * (1 + 2 * workers.GUIDANCE)) == {}
    assert {f"cfg2 x sp{sp}/{v}/{s}" for v in ("t2i", "edit") for s in ("prefill", "cached")} <= set(errors)
    if sp == 1:
        # CFG parallel alone runs one process's sequential-CFG calls (each branch its own layout and
        # cache): the same shapes and kernels, so the same bits
        assert all(
            errors[f"cfg2 x sp1/{v}/{s}"] == 0.0 for v in ("t2i", "edit") for s in ("prefill", "cached")
        )


def test_heads_that_do_not_split_and_a_ring_are_clear_errors():
    model = QwenImage21Transformer(workers.TINY).eval()
    inputs = workers.case_inputs(edit=False)
    layout = BlockCausalLayout.build(inputs["lens"], inputs["grids"], text_width=7)
    t = torch.full((2,), 0.5)
    call = {"attention": workers.IMPLS[0][1](), "metadata": layout}
    with pytest.raises(ValidationError, match=r"8 attention heads do not split over Ulysses degree 3"):
        model(
            inputs["latents"][0],
            t,
            inputs["text"],
            parallel=ParallelLayout(world_size=3, sp_degree=3),
            **call,
        )
    ring = ParallelLayout(world_size=4, sp_degree=4, ring_degree=2)
    with pytest.raises(ValidationError, match=r"Ulysses only, not a ring"):
        model(inputs["latents"][0], t, inputs["text"], parallel=ring, **call)
    # a cache filled in one process is not read by a Ulysses call (it holds every head)
    cache = PrefixCache()
    with torch.no_grad():
        model(inputs["latents"][0], t, inputs["text"], cache=cache, **call)
    with pytest.raises(ValidationError, match=r"holds 8 heads per row, this call attends 4"):
        model(
            inputs["latents"][1],
            t,
            None,
            cache=cache,
            parallel=ParallelLayout(world_size=2, sp_degree=2),
            **call,
        )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_ulysses_on_two_gpus_equals_one_gpu():
    """The same cases over NCCL on 2 GPUs (spawned ranks), fp32. cuBLAS may pick other GEMM kernels
    (split-K) for a shard's row count than for all rows, and the Triton row kernels round once per
    pass: fp32 differences of ~1e-6 relative per op, hence 1e-4 on O(1) outputs, far below what a
    wrong shard or exchange moves (1e-3 and more)."""
    from mmgen.parallel.launch import run_parallel

    errors = run_parallel(workers.cuda_model_errors, ParallelConfig(sp=2), device_type="cuda")
    assert len(errors) == 2 * 2 * 3
    assert {name: err for name, err in errors.items() if not err <= 1e-4} == {}
