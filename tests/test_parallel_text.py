"""Read and encoded once per world: rank 0 runs the text encoder, the other ranks get its exact output
(mmgen.parallel.share.from_first_rank) and read no text-encoder weights (reads_for_world);
with the weights on the device the other ranks split the transformers' reads and send each tensor from
the rank that read it (SplitReads, share_weights, into tensors load_into_module allocated unread).

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


def test_only_rank_0_reads_the_weights_and_every_rank_holds_and_plans_alike(default_model_dir):
    held = parallel_workers.run_forked(
        parallel_workers.text_encoder_holders, ParallelConfig(sp=2, cfg=True), default_model_dir
    )
    assert [on_meta for on_meta, *_ in held] == [False, True, True, True]
    assert len({size for _, size, *_ in held}) == 1  # the same sizes: the same memory plan on every rank
    assert all(plan == held[0][2] for _, _, plan, _ in held)
    # the DiT each rank holds is the one a single process reads, byte for byte
    from pipelines.wan_t2v import WanT2VPipeline

    alone = parallel_workers.state_digest(WanT2VPipeline.from_pretrained(default_model_dir).transformer)
    assert [digest for *_, digest in held] == [alone] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_unloaded_encoder_has_the_loaded_ones_structure_and_bytes(default_model_dir, dtype):
    loaded = load_umt5_encoder(default_model_dir / "text_encoder", dtype=dtype)
    unloaded = load_umt5_encoder(default_model_dir / "text_encoder", dtype=dtype, weights=False)
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
def test_the_ranks_but_0_split_a_transformers_reads_into_runs_of_about_equal_elements(world):
    from mmgen.parallel.share import SplitReads

    with torch.device("meta"):
        module = torch.nn.Sequential(*(torch.nn.Linear(64, 64 + 8 * i) for i in range(9)))
        module[8].weight = module[0].weight = torch.nn.Parameter(torch.empty(64, 64))  # a tie: one tensor
    readers = SplitReads(0, world).readers(module)
    assert len(readers) == len(module.state_dict()) - 1 and readers == sorted(readers)  # contiguous runs
    assert set(readers) == set(range(1, world))  # rank 0 reads none (it reads the text encoder)
    sizes = [t.numel() for t in dict.fromkeys(module.state_dict(keep_vars=True).values())]
    parts = [sum(s for s, r in zip(sizes, readers, strict=True) if r == rank) for rank in range(1, world)]
    assert max(parts) - min(parts) <= max(sizes)  # equal within one tensor
    names = [SplitReads(rank, world)(module) for rank in range(world)]
    assert set().union(*names) == set(module.state_dict()) and sum(map(len, names)) == len(
        module.state_dict()
    )
    assert {"0.weight", "8.weight"} <= names[1]  # a tied tensor is read under each of its names
    assert SplitReads(0, 1)(module) == set(module.state_dict())  # one process reads all


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
