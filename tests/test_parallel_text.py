"""The text is encoded once per world: rank 0 runs the text encoder, the other ranks get its exact output
(mmgen.parallel.share.from_first_rank) and read no text-encoder weights (ParallelLayout.encodes_text).

That a world's outputs still equal one process's is test_parallel_generate's (Wan) and
test_qwen_image21_parallel's (Qwen-Image-2.1, text-to-image and an edit) work; these pin the parts.
"""

from __future__ import annotations

import parallel_workers
import pytest
import torch

from mmgen.loading.umt5 import load_umt5_encoder, unloaded_umt5
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


def test_only_rank_0_reads_the_text_encoder_and_every_rank_plans_alike(default_model_dir):
    held = parallel_workers.run_forked(
        parallel_workers.text_encoder_holders, ParallelConfig(sp=2, cfg=True), default_model_dir
    )
    assert [on_meta for on_meta, _, _ in held] == [False, True, True, True]
    assert len({size for _, size, _ in held}) == 1  # the same sizes: the same memory plan on every rank
    assert all(plan == held[0][2] for _, _, plan in held)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_an_unloaded_encoder_has_the_loaded_ones_structure_and_bytes(default_model_dir, dtype):
    loaded = load_umt5_encoder(default_model_dir / "text_encoder", dtype=dtype)
    unloaded = unloaded_umt5(loaded.config, dtype)
    assert module_bytes(unloaded) == module_bytes(loaded)
    shapes = {name: (p.shape, p.dtype) for name, p in loaded.named_parameters()}
    assert {name: (p.shape, p.dtype) for name, p in unloaded.named_parameters()} == shapes
    assert all(p.is_meta for p in unloaded.parameters())
