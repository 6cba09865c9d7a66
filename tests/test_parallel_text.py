"""Read and encoded once per world: rank 0 runs the text encoder, the other ranks get its exact output
(mmgen.parallel.share.from_first_rank) and keep no text encoder (reads_for_world); with the weights on
the device the ranks split the text encoder's and the transformers' reads and send each tensor from the
rank that read it to the ranks that keep it (SplitReads, share_reads, into tensors load_into_module
allocated unread).

That a world's outputs still equal one process's is test_parallel_generate's (Wan) and
test_qwen_image21_parallel's (Qwen-Image-2.1, text-to-image and an edit) work; these pin the parts.
"""

from __future__ import annotations

import parallel_workers
import pytest
import torch

from mmgen.loading.umt5 import load_umt5_encoder
from mmgen.parallel.layout import ParallelConfig
from mmgen.placement.tensors import module_bytes


def test_first_rank_value_reaches_every_rank_with_its_bits_and_shape():
    copies, kept, _ = parallel_workers.run_forked(parallel_workers.shared_values, ParallelConfig(sp=3))
    assert kept  # rank 0 gets its own object back, nothing copied
    first = copies[0]
    assert first.lengths == (7, 4) and first.slots.dtype == torch.bool
    for copy in copies[1:]:
        assert type(copy) is type(first) and copy.lengths == first.lengths
        for mine, theirs in ((copy.states, first.states), (copy.slots, first.slots)):
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
        assert copy.extra[:2] == ["text", None] and isinstance(copy.extra[2], tuple)
        assert torch.equal(copy.extra[2][0], first.extra[2][0]) and copy.extra[2][1] == 2.5


def test_an_error_on_rank_0_is_every_ranks_error_and_the_world_goes_on():
    """A group fails the job together (as when every rank encoded for itself), none left waiting."""
    *_, errors = parallel_workers.run_forked(parallel_workers.shared_values, ParallelConfig(sp=2))
    assert errors == ["ValidationError: prompt: too long for the text encoder"] * 2


def test_rank_0_alone_keeps_the_encoder_read_by_all_and_every_rank_holds_and_plans_alike(default_model_dir):
    """The world of 4 splits the text encoder's and the DiT's reads (the fixed split: rank 0 an equal
    share from the encoder's start; this model's encoder is small, so rank 0 reads it all and part of the
    DiT, which it broadcasts): rank 0's encoder and every rank's DiT are a single process's, byte for
    byte. (An encoder read by several ranks: the next tests; through `generate --gpus`'s board:
    test_parallel_generate.)"""

    held = parallel_workers.run_forked(
        parallel_workers.text_encoder_holders, ParallelConfig(sp=2, cfg=True), default_model_dir
    )
    assert [on_meta for on_meta, *_ in held] == [False, True, True, True]
    assert len({size for _, size, *_ in held}) == 1  # the same sizes: the same memory plan on every rank
    assert all(plan == held[0][2] for _, _, plan, *_ in held)
    from pipelines.wan_t2v import WanT2VPipeline

    alone = WanT2VPipeline.from_pretrained(default_model_dir)
    assert [kept for *_, kept, _ in held] == [
        parallel_workers.state_digest(alone.components.text_encoder)
    ] + [None] * 3
    assert [digest for *_, digest in held] == [parallel_workers.state_digest(alone.transformer)] * 4


def test_an_encoder_read_by_several_ranks_is_whole_on_rank_0_and_gone_from_the_others():
    """Each rank reads its pieces of an encoder (kept by rank 0 alone) and a transformer (kept by all) from
    the same checkpoint (the fixed split): after share_reads rank 0's encoder and every rank's transformer
    are the checkpoint's, byte for byte, the others' encoders all on the meta device; a world of 3 (gloo's
    point-to-point sends; NCCL's on the GPU test below)."""
    results = parallel_workers.run_forked(parallel_workers.split_reads_round_trip, ParallelConfig(sp=3))
    encoders, transformers, taken = zip(*results, strict=True)
    assert encoders == ("equal", "meta", "meta") and transformers == ("equal",) * 3
    assert all(taken)  # the encoder's pieces came from every rank
    assert sorted(i for mine in taken for i in mine) == list(range(sum(map(len, taken))))


def test_ranks_taking_pieces_from_one_board_read_each_once_and_complete_the_modules():
    """With a ReadBoard (the ranks `generate --gpus N` starts) each rank takes the next piece as it is
    free: whatever each took, every piece is read once and the modules are whole where kept."""
    import multiprocessing

    from mmgen.parallel.read_board import ReadBoard

    board = ReadBoard(multiprocessing.get_context("fork"))
    results = parallel_workers.run_forked(
        parallel_workers.split_reads_round_trip, ParallelConfig(sp=3), board
    )
    encoders, transformers, taken = zip(*results, strict=True)
    assert encoders == ("equal", "meta", "meta") and transformers == ("equal",) * 3
    assert sorted(i for mine in taken for i in mine) == list(range(sum(map(len, taken))))


def test_a_board_used_for_a_second_load_is_every_ranks_error_naming_the_piece():
    """A board's pieces are taken once: a second load through it reads nothing, and share_reads says so
    on every rank rather than sharing uninitialized memory."""
    import multiprocessing

    from mmgen.parallel.read_board import ReadBoard

    board = ReadBoard(multiprocessing.get_context("fork"))
    lines = parallel_workers.run_forked(
        parallel_workers.split_reads_round_trip, ParallelConfig(sp=2), board, 2
    )
    assert all(line.startswith("LoadError: text_encoder: piece 0 of ") for line in lines), lines
    assert all("was read by 0 ranks" in line for line in lines)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_on_gpus_the_encoders_pieces_reach_rank_0_through_nccls_point_to_point_calls():
    from mmgen.parallel.launch import run_parallel

    world = 4 if torch.cuda.device_count() >= 4 else 2
    results = run_parallel(
        parallel_workers.split_reads_round_trip, ParallelConfig(sp=world), device_type="cuda"
    )
    encoders, transformers, taken = zip(*results, strict=True)
    assert encoders == ("equal",) + ("meta",) * (world - 1) and transformers == ("equal",) * world
    assert all(taken)


def _layout(rank: int, world: int):
    from types import SimpleNamespace

    return SimpleNamespace(rank=rank, world_size=world)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_unloaded_encoder_has_the_loaded_ones_structure_and_bytes(default_model_dir, dtype):
    loaded = load_umt5_encoder(default_model_dir / "text_encoder", dtype=dtype)
    unloaded = load_umt5_encoder(default_model_dir / "text_encoder", dtype=dtype, read=False, keep=False)
    assert module_bytes(unloaded) == module_bytes(loaded)
    shapes = {name: (p.shape, p.dtype) for name, p in loaded.named_parameters()}
    assert {name: (p.shape, p.dtype) for name, p in unloaded.named_parameters()} == shapes
    assert all(p.is_meta for p in unloaded.parameters())


def test_ranks_whose_modules_differ_all_fail_with_one_line_before_any_weight_moves():
    lines = parallel_workers.run_forked(parallel_workers.mismatched_weights, ParallelConfig(sp=2))
    assert all(line.startswith("LoadError: Sequential: the ranks' modules differ") for line in lines), lines
    assert "first difference here: ('1.weight', (5, 4), torch.float32)" in lines[1]


def test_an_unread_load_allocates_every_tensor_as_a_read_would_and_touches_no_byte():
    """Checkpoint tensors on the meta device have no bytes: a read of them would fail; read=False
    needs only their shapes and gives each the dtype a read gives it (keep_fp32 tables in float32)."""
    from pathlib import Path

    from mmgen.loading.safetensors_dir import load_into_module

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
        checkpoint = {name: (torch.empty(t.shape), Path("x")) for name, t in module.state_dict().items()}
    load_into_module(
        module,
        checkpoint,
        source=Path("x"),
        dtype=torch.bfloat16,
        device="cpu",
        keep_fp32=lambda name: name.startswith("1."),
        read=False,
    )
    dtypes = {name: t.dtype for name, t in module.state_dict().items()}
    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes == {"0.weight": bf16, "0.bias": bf16, "1.weight": fp32, "1.bias": fp32}
    assert not any(t.is_meta for t in module.state_dict().values())


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("with_encoder", [False, True])
def test_the_fixed_split_reads_contiguous_runs_of_about_equal_bytes(world, with_encoder):
    """Without the text encoder among the parts (an encoder rank 0 reads whole) rank 0 reads none and
    ranks 1 ... N - 1 split the transformer; with it first, every rank reads an equal share, rank 0 the
    encoder's start. (Without a board: the fixed split every rank computes alike.)"""
    from mmgen.parallel.share import ReadPart, SplitReads

    sizes = {
        "text_encoder": [700 + 90 * i for i in range(12)],
        "transformer": [300 + 40 * i for i in range(30)],
    }
    if not with_encoder:
        del sizes["text_encoder"]
    parts = [ReadPart(name, sum(s), everyone=name != "text_encoder") for name, s in sizes.items()]
    split = SplitReads.over(_layout(0, world), parts)
    readers = [r for name, s in sizes.items() for r in split.fixed_readers(name, s)]
    flat = [size for s in sizes.values() for size in s]
    assert readers == sorted(readers)  # contiguous runs over the parts laid end to end
    reading = list(range(world)) if with_encoder else list(range(1, world))
    assert set(readers) == set(reading)
    shares = [sum(s for s, r in zip(flat, readers, strict=True) if r == rank) for rank in reading]
    assert max(shares) - min(shares) <= 2 * max(flat)  # equal within a piece on either side
    if with_encoder:
        assert split.fixed_readers("text_encoder", sizes["text_encoder"])[0] == 0
    alone = SplitReads.over(_layout(0, 1), parts)
    assert all(set(alone.fixed_readers(name, s)) == {0} for name, s in sizes.items())


def test_a_partial_read_reads_the_claimed_pieces_and_allocates_the_rest_untouched(monkeypatch):
    """The unread tensors' checkpoint copies are on the meta device (no bytes): a read of one would fail."""
    from pathlib import Path

    from mmgen.loading.safetensors_dir import load_into_module
    from mmgen.placement import upload as upload_module

    monkeypatch.setattr(upload_module, "MIN_PIECE_BYTES", 4)  # a piece per tensor of this small module
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    values = {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4)}
    checkpoint = {
        name: (values.get(name, torch.empty(tuple(t.shape), device="meta")), Path("x"))
        for name, t in module.state_dict().items()
    }

    def claims(pieces, sizes):
        mine = iter([i for i, piece in enumerate(pieces) if all(name in values for name, _, _ in piece)])
        return lambda: next(mine, None)

    load_into_module(module, checkpoint, source=Path("x"), dtype=torch.float32, device="cpu", read=claims)
    state = module.state_dict()
    assert all(torch.equal(state[name], value) for name, value in values.items())
    assert not any(t.is_meta for t in state.values()) and state["1.weight"].shape == (2, 4)


@pytest.mark.parametrize("offload", ["model", "layer"])
def test_offloaded_ranks_without_a_text_encoder_match_one_process(default_model_dir, offload):
    """Under offload every rank reads its own DiT into host memory (nothing shared) and only rank 0
    places a text encoder (OffloadPlacement(text_encoder=None) elsewhere). Tolerance: as
    test_parallel_generate's (a sequence shard's GEMM shapes; ~2e-5 measured, a wrong exchange O(0.1))."""
    single = parallel_workers.generate_latents(None, default_model_dir, offload)
    latents = parallel_workers.run_forked(
        parallel_workers.generate_latents, ParallelConfig(sp=2), default_model_dir, offload
    )
    torch.testing.assert_close(latents, single, atol=1e-4, rtol=1e-4)
