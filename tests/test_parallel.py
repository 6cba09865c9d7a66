"""mmgen.parallel on CPU: Ulysses, Ring, Ulysses x Ring, the sharded DiT and CFG parallel in gloo worlds
of 2 and 4 processes started by the tests, each against the single-process result (fp32, <= 1e-5); head-count
errors; a failing rank stops the run with one line; the layout's groups are values, not globals.

The worlds are forked (run_parallel's CPU-only start method, through parallel_workers.run_forked: one
torch thread per child, as libgomp's pool does not survive fork): spawned interpreters would spend ~10 s
each importing torch on a 2-core runner. One world of each size runs every check; the tests read
its results. test_spawned_world_runs covers the spawn path users get once.
"""

from __future__ import annotations

import time

import parallel_spawn_worker
import parallel_workers
import pytest
import torch
import torch.distributed as dist

from mmgen.attention import FlashAttentionImpl, SDPAImpl
from mmgen.attention.metadata import AttentionMetadata
from mmgen.errors import ValidationError
from mmgen.kernels import ReferenceFlashAttention
from mmgen.parallel.attention import (
    SequenceParallelAttention,
    attention_with_lse,
    merge_partial,
    self_attention_provider,
)
from mmgen.parallel.launch import RankFailed, init_process, run_parallel
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.parallel.sequence import SequenceShard

# Max abs difference from one process. Every layout runs the same math through other shapes:
# Ulysses attends over all tokens of fewer heads (a padded count adds a key-length mask), Ring merges
# blockwise softmaxes by their LSE, the sharded DiT runs its GEMMs on fewer rows. That is fp32
# rounding, a few ulps (2^-24 relative) per op, and it depends on which kernel a CPU's BLAS picks for
# each shape. Values here are O(1) (|x| < 4): 1e-5 is ~40 ulps of the largest; measured <= 3.6e-7
# (AMD EPYC, 1 and 2 threads); a wrong shard, exchange or merge moves values by O(0.1).
TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_errors(request) -> tuple[int, dict[str, float]]:
    return request.param, parallel_workers.run_forked(
        parallel_workers.everything, ParallelConfig(sp=request.param)
    )


def _close(errors: dict[str, float], prefix: str, tolerance: float = TOLERANCE) -> dict[str, float]:
    picked = {name: err for name, err in errors.items() if name.startswith(prefix)}
    assert picked, f"no results named {prefix!r}: {sorted(errors)}"
    return {name: err for name, err in picked.items() if not err <= tolerance}


def test_ulysses_ring_and_both_equal_one_process(world_errors):
    world, errors = world_errors
    layouts = [f"ulysses{world}", f"ring{world}"] + (["ulysses2xring2/"] if world == 4 else [])
    for layout in layouts:
        assert _close(errors, layout) == {}
    # padded token counts (4 * world + 1) were among them, for both impls
    assert any(name.endswith(f"S={4 * world + 1}/H=4") for name in errors)


def test_whole_dit_under_sp_equals_one_process(world_errors):
    world, errors = world_errors
    assert _close(errors, f"sp{world}/") == {}
    assert f"sp{world}/grid(3, 6, 10)" in errors  # 45 tokens: not divisible by the degree
    # per-token timesteps (Wan2.2 TI2V) are sharded with the tokens, padded count included
    assert f"sp{world}/per-token/grid(3, 6, 10)" in errors
    if world == 4:
        assert _close(errors, "ulysses2xring2/") == {}


def test_ulysses_with_8_heads_equals_one_process(world_errors):
    """8 heads: each rank holds 4 (world 2) or 2 (world 4) heads after the exchange, so a head order
    slip inside a rank's group fails at both world sizes (4 heads over 4 ranks hold one each)."""
    world, errors = world_errors
    eight = {name: err for name, err in errors.items() if "H=8" in name}
    ulysses = [f"ulysses{world}/"] + (["ulysses2xring2/"] if world == 4 else [])
    for layout in ulysses:
        for impl_name, _ in parallel_workers.IMPLS:
            for tokens in (4 * world, 4 * world + 1):
                assert f"{layout}{impl_name}/S={tokens}/H=8" in eight
    for grid in ("grid(2, 4, 8)/H=8", "grid(3, 6, 10)/H=8", "per-token/grid(3, 6, 10)/H=8"):
        assert f"sp{world}/{grid}" in eight
    assert {name: err for name, err in eight.items() if not err <= TOLERANCE} == {}


def test_the_output_head_projects_the_whole_sequence_as_one_process(world_errors):
    """The DiT's last projection runs on one process's rows on every rank (the whole gathered sequence,
    whole or in the same chunks), so a kernel chosen by the row count (a GPU's) gives one process's bits:
    with a projection whose output moves by 1e-3 x its call's rows, projecting a shard's rows is off by
    >= 1e-3 x 22 (45 tokens over 2 ranks)."""
    world, errors = world_errors
    for chunk in (None, 16):
        assert errors[f"head/sp{world}/chunk={chunk}"] <= TOLERANCE


def test_cfg_parallel_step_equals_one_process(world_errors):
    _, errors = world_errors
    # uncond + s * (cond - uncond) carries each branch's rounding amplified by up to 1 + 2s
    assert _close(errors, "cfg2", TOLERANCE * (1 + 2 * parallel_workers.GUIDANCE)) == {}
    if "cfg2 x sp1" in errors:
        # CFG parallel alone runs the very batch-1 calls of one process's sequential CFG: same
        # shapes, same kernels, so the same bits (the batched default differs by GEMM rounding)
        assert errors["cfg2 x sp1"] == 0.0


def test_failing_rank_stops_the_run_with_one_line():
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"^rank 1 failed: job 'x': frames 6 must be 4k\+1") as caught:
        parallel_workers.run_forked(parallel_workers.failing_rank, ParallelConfig(sp=2), timeout_s=120)
    # rank 0 sat in a collective with a 120 s timeout; the launcher stopped it instead
    assert time.monotonic() - start < 10
    assert "\n" not in str(caught.value)


def test_group_start_runs_the_first_collectives_of_every_group():
    """init_layout exchanges on each group of more than one rank (small and large: NCCL sets up a
    communicator and each protocol at first use), so no job pays that set-up (issue 38)."""
    found = parallel_workers.run_forked(parallel_workers.warm_up_exchanges, ParallelConfig(sp=4))
    # one communicator per set of ranks: SP and Ulysses over all four ranks are the world's group
    assert found["ulysses4"] == ({"world": 4}, [4] * 2)
    # CFG 2 x Ulysses 2: rank 0's world, its SP pair (its Ulysses pair: the same ranks, the same group)
    # and its CFG pair
    assert found["cfg2xulysses2"] == ({"world": 4, "sp": 2, "cfg": 2}, [2] * 4 + [4] * 2)
    assert found["ulysses2xring2"] == ({"world": 4, "ulysses": 2, "ring": 2}, [2] * 4 + [4] * 2)


def test_nccl_ranks_bind_their_gpu_so_the_communicators_are_made_at_start(monkeypatch):
    """Under NCCL each rank's process group is bound to its GPU (device_id: the world's communicator
    made at init, the layout's groups split from it, both before any job); gloo ranks are not bound."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: calls.append((args, kwargs)))
    address = "tcp://127.0.0.1:1"
    assert init_process(1, 2, "cuda", 5.0, address, first_device=2) == torch.device("cuda", 3)
    assert init_process(1, 2, "cpu", 5.0, address) == torch.device("cpu")
    (nccl, bound), (gloo, unbound) = calls
    assert (nccl, bound["device_id"]) == (("nccl",), torch.device("cuda", 3))
    assert (gloo, unbound["device_id"]) == (("gloo",), None)


def test_heads_not_divisible_by_ulysses_is_a_clear_error():
    layout = ParallelLayout(world_size=4, sp_degree=4)
    with pytest.raises(
        ValidationError, match=r"14 attention heads do not split over Ulysses degree 4 .*\[1, 2\]"
    ):
        layout.check_heads(14)
    wrapper = SequenceParallelAttention(SDPAImpl(), ParallelLayout(world_size=2, sp_degree=2))
    shard = SequenceShard.plan(6, ParallelLayout(world_size=2, sp_degree=2))
    q = torch.zeros(1, 3, 3, 8)
    with pytest.raises(ValidationError, match="3 attention heads .* Ulysses degree 2 .* ring"):
        wrapper(q, q, q, shard.metadata(1, q.device))
    # with a ring the same layout size takes any head count
    ParallelLayout(world_size=2, sp_degree=2, ring_degree=2).check_heads(3)


def test_padded_shard_metadata_holds_every_rows_token_count():
    # 45 tokens over 4 ranks: padded to 48, so the gathered call masks keys past 45 in each row.
    shard = SequenceShard.plan(45, ParallelLayout(world_size=4, sp_degree=4))
    gathered = shard.metadata(3, torch.device("cpu")).gathered
    expected = AttentionMetadata.from_lengths(None, torch.full((3,), 45, dtype=torch.int32))
    assert gathered.cu_seqlens_q is None and gathered.max_seqlen_q is None
    assert gathered.cu_seqlens_k.dtype == torch.int32
    assert gathered.cu_seqlens_k.tolist() == expected.cu_seqlens_k.tolist() == [0, 45, 90, 135]
    assert gathered.max_seqlen_k == expected.max_seqlen_k == 45
    # nothing padded: dense
    assert (
        SequenceShard.plan(48, ParallelLayout(world_size=4, sp_degree=4)).metadata(3, "cpu").gathered.is_dense
    )


def test_parallel_config_checks_and_gpus():
    assert ParallelConfig.for_gpus(4, cfg=True) == ParallelConfig(sp=2, cfg=True)
    assert ParallelConfig.for_gpus(4, sp=4, ring=2) == ParallelConfig(sp=4, ring=2)
    assert ParallelConfig(sp=4, ring=2).ulysses == 2 and ParallelConfig(sp=2, cfg=True).world_size == 4
    with pytest.raises(ValidationError, match="--gpus 4 does not match --sp 3"):
        ParallelConfig.for_gpus(4, sp=3)
    with pytest.raises(ValidationError, match="ring degree 3 must divide"):
        ParallelConfig(sp=4, ring=3)


def test_lse_merge_of_two_key_blocks_equals_one_softmax_over_the_valid_keys():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 4, generator=g) for n in (5, 6, 6))
    kernel = ReferenceFlashAttention()
    a = attention_with_lse(kernel, q, k[:, :3], v[:, :3], 3, 0.5)
    b = attention_with_lse(kernel, q, k[:, 3:], v[:, 3:], 2, 0.5)  # the block's last key is padding
    merged, _ = merge_partial(*a, *b)
    # independent: one float64 softmax over the 5 valid keys
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k[:, :5].double()) * 0.5
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v[:, :5].double())
    assert (merged - expected).abs().max().item() <= 1e-6  # two 3-key fp32 blocks: a few ulps of O(1) values
    empty = (torch.zeros_like(a[0]), torch.full_like(a[1], float("-inf")))  # a block with no valid key
    assert torch.equal(merge_partial(*empty, *empty)[0], torch.zeros_like(a[0], dtype=torch.float64))


def test_spawned_world_runs():
    """The default start method (fresh interpreters, as `mmgen generate --gpus 2` uses) end to end."""
    assert run_parallel(parallel_spawn_worker.world_ranks, ParallelConfig(sp=2)) == [0, 1]


def test_ranks_started_before_the_run_are_the_ranks_that_run_it():
    """`generate --gpus N` spawns its ranks before it parses (mmgen.parallel.standby): the run is handed
    to those processes (their imports done meanwhile), no new ones spawn, and they stop on close."""
    from mmgen.parallel.standby import StartedRanks

    with StartedRanks(2, ("torch", "mmgen.parallel.launch")) as started:
        pids = [process.pid for process in started.processes]
        assert run_parallel(parallel_spawn_worker.world_pids, ParallelConfig(sp=2), started=started) == pids
    assert not any(process.is_alive() for process in started.processes)
    # as many as the run needs, or none of them: a run of another size spawns its own
    with StartedRanks(1) as one:
        assert run_parallel(parallel_spawn_worker.world_ranks, ParallelConfig(sp=2), started=one) == [0, 1]
        # stopped once the run spawned its own: on CUDA it would hold a context on a GPU the run takes
        assert not one.processes[0].is_alive()


def test_ranks_that_joined_their_world_early_run_it_and_another_layout_spawns_its_own():
    """With an EarlyWorld the started processes join it (process group, layout, warm-up) while the
    launcher parses; a run of that layout is handed to them, a run of another layout is not."""
    from dataclasses import replace

    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    world = EarlyWorld(2, None, 1, False, f"tcp://127.0.0.1:{free_port()}", DEFAULT_TIMEOUT_S)
    with StartedRanks(2, ("torch", "mmgen.parallel.launch"), world=world) as started:
        pids = [process.pid for process in started.processes]
        assert run_parallel(parallel_spawn_worker.world_pids, ParallelConfig(sp=2), started=started) == pids
    cfg = replace(world, cfg=True, address=f"tcp://127.0.0.1:{free_port()}")
    with StartedRanks(2, (), world=cfg) as other:  # --cfg-parallel was read ahead; the run is Ulysses 2
        assert not other.fits(ParallelConfig(sp=2), 1, DEFAULT_TIMEOUT_S)
        assert other.fits(ParallelConfig(cfg=True), 1, DEFAULT_TIMEOUT_S)
        ran = run_parallel(parallel_spawn_worker.world_pids, ParallelConfig(sp=2), started=other)
        assert len(ran) == 2 and not set(ran) & {process.pid for process in other.processes}


def test_a_run_that_settles_its_layout_gets_it_while_the_world_joins():
    """`generate`'s ranks (settles=True) take their work while their early world still joins in a thread
    (standby.PendingSetup): fn gets a PendingLayout and settles it after its first work (the load);
    without settles fn gets the joined layout, as every other run does."""
    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    for settles, given in ((True, "PendingLayout"), (False, "ParallelLayout")):
        world = EarlyWorld(2, None, 1, False, f"tcp://127.0.0.1:{free_port()}", DEFAULT_TIMEOUT_S)
        with StartedRanks(2, ("torch", "mmgen.parallel.launch"), world=world) as started:
            found = run_parallel(
                parallel_spawn_worker.pending_then_ranks,
                ParallelConfig(sp=2),
                started=started,
                settles=settles,
            )
        assert found == (given, 2, [0, 1])
    # spawned ranks (no early world) join before fn runs, settles or not
    found = run_parallel(parallel_spawn_worker.pending_then_ranks, ParallelConfig(sp=2), settles=True)
    assert found == ("ParallelLayout", 2, [0, 1])


def test_a_started_rank_times_its_world_join_in_order():
    """A started rank's EarlySetup stamps (benchmarks/rank_start.py prints them): the join began, its
    device set, its process group made, its world joined, in that order, and its imports done."""
    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    world = EarlyWorld(2, None, 1, False, f"tcp://127.0.0.1:{free_port()}", DEFAULT_TIMEOUT_S)
    with StartedRanks(2, ("torch", "mmgen.parallel.launch"), world=world) as started:
        for position in range(2):
            started.assign(position, parallel_spawn_worker.early_setup_times, ())
        found = sorted((started.results.get(timeout=120) for _ in range(2)), key=lambda row: row[0])
    assert [row[:2] for row in found] == [(0, None), (1, None)]
    for _, _, times in found:
        assert 0 < times["began"] <= times["device"] <= times["process"] <= times["joined"]
        assert times["imported"] > 0


def test_a_started_rank_that_ends_before_its_work_fails_the_run():
    from mmgen.parallel.standby import StartedRanks

    with StartedRanks(2) as started:
        started.processes[1].kill()
        started.processes[1].join()
        with pytest.raises(RankFailed, match="rank 1"):
            run_parallel(parallel_spawn_worker.world_ranks, ParallelConfig(sp=2), started=started)


def test_results_name_the_kernel_that_runs_the_sharded_self_attention():
    single = ParallelLayout.single()
    assert self_attention_provider(SDPAImpl(), single) == "sdpa:sdpa"
    assert (
        self_attention_provider(SDPAImpl(), ParallelLayout(world_size=2, sp_degree=2)) == "sdpa:sdpa ulysses2"
    )
    # the ring needs an LSE: with SDPA it runs the flash reference kernel, and says so
    ring = ParallelLayout(world_size=4, sp_degree=4, ring_degree=2)
    assert self_attention_provider(SDPAImpl(), ring) == "flash:reference ulysses2 x ring2"
    assert (
        self_attention_provider(FlashAttentionImpl("reference"), ring) == "flash:reference ulysses2 x ring2"
    )
