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
    """The world of 4 splits the text encoder's reads (rank 0 an equal share of the encoder and the DiT)
    and the DiT's: rank 0's encoder and every rank's DiT are a single process's, byte for byte."""
    from mmgen.loading.diffusers_dir import wan_read_elements
    from mmgen.parallel.share import ReadPart, SplitReads

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
    # what the split gives this model (its encoder is small): rank 0 reads the encoder and part of the DiT,
    # which it then broadcasts (an encoder read by several ranks: the next test)
    elements = wan_read_elements(default_model_dir)
    parts = [ReadPart(name, n, everyone=name != "text_encoder") for name, n in elements.items()]
    split = SplitReads.over(_layout(0, 4), parts)
    assert set(split.readers("text_encoder", alone.components.text_encoder)) == {0}
    assert set(split.readers("transformer", alone.transformer)) == {0, 1, 2, 3}


def test_an_encoder_read_by_several_ranks_is_whole_on_rank_0_and_gone_from_the_others():
    """Each rank reads its part of an encoder (kept by rank 0 alone) and a transformer (kept by all) from
    the same checkpoint: after share_reads rank 0's encoder and every rank's transformer are the
    checkpoint's, byte for byte, the others' encoders all on the meta device; a world of 3 (gloo's
    point-to-point sends, NCCL's on the GPU tests)."""
    results = parallel_workers.run_forked(parallel_workers.split_reads_round_trip, ParallelConfig(sp=3))
    encoders, transformers, readers = zip(*results, strict=True)
    assert encoders == ("equal", "meta", "meta")
    assert transformers == ("equal",) * 3
    assert set(readers[0]) == {0, 1, 2}  # the encoder's tensors came from every rank


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_on_gpus_the_encoders_parts_reach_rank_0_through_nccls_point_to_point_calls():
    from mmgen.parallel.launch import run_parallel

    world = 4 if torch.cuda.device_count() >= 4 else 2
    results = run_parallel(
        parallel_workers.split_reads_round_trip, ParallelConfig(sp=world), device_type="cuda"
    )
    encoders, transformers, readers = zip(*results, strict=True)
    assert encoders == ("equal",) + ("meta",) * (world - 1) and transformers == ("equal",) * world
    assert set(readers[0]) == set(range(world))


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


def _split(rank: int, world: int, modules: dict, encoder: str | None = None):
    """SplitReads of rank `rank` of `world` over `modules` ({name: meta module}, in order; `encoder`: the
    one rank 0 alone keeps), each part's elements its module's (a tie counted once)."""
    from types import SimpleNamespace

    from mmgen.parallel.share import ReadPart, SplitReads

    parts = [
        ReadPart(
            name,
            sum(t.numel() for t in dict.fromkeys(m.state_dict(keep_vars=True).values())),
            name != encoder,
        )
        for name, m in modules.items()
    ]
    return SplitReads.over(SimpleNamespace(rank=rank, world_size=world), parts)


def _tied_meta_modules() -> dict:
    with torch.device("meta"):
        text = torch.nn.Sequential(*(torch.nn.Linear(64, 48 + 16 * i) for i in range(6)))
        dit = torch.nn.Sequential(*(torch.nn.Linear(64, 64 + 8 * i) for i in range(9)))
        dit[8].weight = dit[0].weight = torch.nn.Parameter(torch.empty(64, 64))  # a tie: one tensor
    return {"text_encoder": text, "transformer": dit}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("with_encoder", [False, True])
def test_the_ranks_split_the_reads_into_contiguous_runs_of_about_equal_elements(world, with_encoder):
    """Without the text encoder among the parts (an encoder rank 0 reads whole) rank 0 reads none and
    ranks 1 ... N - 1 split the transformer; with it first, every rank reads an equal share, rank 0 the
    encoder's start."""
    modules = _tied_meta_modules()
    if not with_encoder:
        del modules["text_encoder"]
    encoder = "text_encoder" if with_encoder else None
    split = _split(0, world, modules, encoder)
    readers = [r for name, module in modules.items() for r in split.readers(name, module)]
    assert readers == sorted(readers)  # contiguous runs over the parts laid end to end
    sizes = [
        t.numel() for m in modules.values() for t in dict.fromkeys(m.state_dict(keep_vars=True).values())
    ]
    reading = list(range(world)) if with_encoder else list(range(1, world))
    assert set(readers) == set(reading)
    shares = [sum(s for s, r in zip(sizes, readers, strict=True) if r == rank) for rank in reading]
    assert max(shares) - min(shares) <= 2 * max(sizes)  # equal within a tensor on either side
    if with_encoder:
        assert split.readers("text_encoder", modules["text_encoder"])[0] == 0  # rank 0 starts the encoder
    for name, module in modules.items():
        names = [_split(rank, world, modules, encoder).reads()[name](module) for rank in range(world)]
        every = set(module.state_dict())
        assert set().union(*names) == every and sum(map(len, names)) == len(every)
    dit_names = [
        _split(rank, world, modules, encoder).reads()["transformer"](modules["transformer"])
        for rank in range(world)
    ]
    assert any({"0.weight", "8.weight"} <= mine for mine in dit_names)  # a tied tensor read under each name
    alone = _split(0, 1, modules, encoder).reads()
    assert all(alone[name](module) == set(module.state_dict()) for name, module in modules.items())


def test_a_partial_read_reads_the_named_tensors_and_allocates_the_rest_untouched():
    """The unread tensors' checkpoint copies are on the meta device (no bytes): a read of one would fail."""
    from pathlib import Path

    from mmgen.loading.safetensors_dir import load_into_module

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    values = {"0.weight": torch.randn(4, 3), "0.bias": torch.randn(4)}
    checkpoint = {
        name: (values.get(name, torch.empty(tuple(t.shape), device="meta")), Path("x"))
        for name, t in module.state_dict().items()
    }
    load_into_module(
        module, checkpoint, source=Path("x"), dtype=torch.float32, device="cpu", read=lambda m: set(values)
    )
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
