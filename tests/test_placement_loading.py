"""Loading straight into the offload's host buffers (mmgen.placement.PinnedStore): each checkpoint tensor
is read into one buffer of the store, and the placement keeps those buffers as its host copies (the
same memory, nothing copied). On the CPU the store's buffers are unpinned; the CUDA test checks the
page-locking too."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from test_placement import forward, side_modules, tiny_expert, tiny_inputs
from wan_cases import TINY

from mmgen.attention import select_attention
from mmgen.loading.safetensors_dir import load_into_module, read_tensors
from mmgen.loading.wan_transformer import wan_dit_from_tensors
from mmgen.models.settings import ExecutionSettings
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.stream import BlockStream
from mmgen.placement.tensors import PinnedStore
from pipelines.wan_t2v import WanT2VPipeline

RANDOM = "<test weights>"


def _saved(tmp_path, module: torch.nn.Module) -> dict:
    path = tmp_path / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    return read_tensors([path])


def _storages(module: torch.nn.Module) -> set[int]:
    return {p.untyped_storage().data_ptr() for p in module.parameters()}


def test_weights_load_into_the_store_and_the_placement_keeps_those_buffers(tmp_path):
    source = tiny_expert(0)
    expected = forward(source)
    store = PinnedStore(register=False)
    model = wan_dit_from_tensors(
        TINY, _saved(tmp_path, source), source=RANDOM, dtype=torch.float32, device="cpu", host=store
    )
    params = list(model.parameters())
    # One buffer per tensor, each the storage of its parameter (offset 0, exactly its bytes).
    assert store.made == len(params) and _storages(model) == set(store._buffers)
    block_ptrs = [_storages(block) for block in model.blocks]
    placement = OffloadPlacement("layer", experts=[model], device="cpu", host=store, **side_modules())
    groups = [placement.stream._groups[id(block)] for block in model.blocks]
    # Every block's host copy is the buffer it was loaded into: adopted, none copied.
    assert all(g.copied == 0 and g.adopted == len(block_ptrs[0]) for g in groups)
    assert [{h.data_ptr() for h in g.host} for g in groups] == block_ptrs
    # The rest of the expert went to the "device"; the store was closed with nothing left in it.
    assert store.taken == sum(len(p) for p in block_ptrs) and store.nbytes == 0
    torch.testing.assert_close(forward(model), expected, atol=0, rtol=0)  # same shapes: same bits
    placement.release()


def test_loading_into_the_store_adds_one_copy_and_placing_adds_none(tmp_path):
    # 8 blocks of 8 MiB (float32): resident anonymous memory grows by one copy of them while they
    # are read (the safetensors file is memory-mapped), and not at all when they are placed.
    blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 2048, bias=False) for _ in range(8))
    tensors = _saved(tmp_path, blocks)
    size = sum(p.numel() * 4 for p in blocks.parameters())
    del blocks
    with torch.device("meta"):
        target = torch.nn.ModuleList(torch.nn.Linear(1024, 2048, bias=False) for _ in range(8))
    store = PinnedStore(register=False)
    before = _anonymous_bytes()
    load_into_module(target, tensors, source=RANDOM, dtype=torch.float32, device="cpu", host=store)
    loaded = _anonymous_bytes()
    stream = BlockStream("cpu", pin=False)
    stream.add(target, adopt=store)
    placed = _anonymous_bytes()
    assert 0.9 * size < loaded - before < 1.25 * size
    assert placed - loaded < 0.1 * size
    assert all(g.adopted == 1 and g.copied == 0 for g in stream._groups.values())


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_a_store_buffer_only_matches_its_own_storage():
    store = PinnedStore(register=False)
    tensor = store.empty((3, 5), torch.bfloat16)
    assert tensor.untyped_storage().nbytes() == 30 and tensor.untyped_storage().data_ptr() % 4096 == 0
    assert store.take(torch.empty(15, dtype=torch.bfloat16).untyped_storage()) is None
    assert store.take(tensor.untyped_storage()) is not None and store.taken == 1
    assert store.take(tensor.untyped_storage()) is None  # taken once
    assert store.empty((0, 4), torch.float32).shape == (0, 4) and store.made == 1


def test_from_pretrained_with_offload_loads_into_the_store(default_model_dir):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir, offload="layer")
    store = pipe._host
    assert isinstance(store, PinnedStore) and store.made > 0
    call = dict(height=32, width=48, num_frames=5, num_inference_steps=1, seed=3, progress=False)
    offloaded = pipe("a red ball", **call)
    assert pipe._host is None and store.nbytes == 0  # taken or released by the placement
    groups = list(pipe.placement.stream._groups.values())
    assert groups and all(g.copied == 0 and g.adopted > 0 for g in groups)
    text_groups = list(pipe.placement.text_stream._groups.values())
    assert text_groups and all(g.copied == 0 for g in text_groups)
    resident = WanT2VPipeline.from_pretrained(default_model_dir)("a red ball", **call)
    assert offloaded.latents_sha256 == resident.latents_sha256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_store_buffers_are_pinned_and_kept_by_the_placement(tmp_path):
    source = tiny_expert(0)
    store = PinnedStore()
    assert store.register
    model = wan_dit_from_tensors(
        TINY, _saved(tmp_path, source), source=RANDOM, dtype=torch.float32, device="cpu", host=store
    )
    buffers = {ptr: buffer for ptr, buffer in store._buffers.items()}
    assert all(b.registered for b in buffers.values())
    placement = OffloadPlacement("layer", experts=[model], device="cuda", host=store, **side_modules())
    kept = [b for g in placement.stream._groups.values() for b in g._pinned]
    assert kept and all(b is buffers[b.buffer.data_ptr()] and b.registered for b in kept)
    x, t, text = (v.cuda() for v in tiny_inputs())
    cuda_attention = select_attention("sdpa", device=torch.device("cuda"), dtype=torch.float32, head_dim=16)
    out = model(
        x, t, text, attention=cuda_attention, settings=ExecutionSettings(block_stream=placement.stream)
    )
    expected = source.cuda()(x, t, text, attention=cuda_attention)
    assert torch.equal(out, expected)
    placement.release()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_store_page_locks_its_buffers_when_locked_or_else_when_taken():
    """empty() leaves a buffer's pages unlocked for the read to write first; lock() page-locks every
    buffer made so far; one taken before a lock() is page-locked as it is taken."""
    store = PinnedStore()
    first = store.empty((4, 1024), torch.float32)
    first.fill_(1.0)
    (made,) = store._buffers.values()
    assert not made.registered and not first.is_pinned()
    store.lock()
    assert made.registered and first.is_pinned()
    second = store.empty((8,), torch.bfloat16)
    assert not second.is_pinned()
    taken = store.take(second.untyped_storage())
    assert taken is not None and taken.registered and second.is_pinned()
    assert torch.equal(first.cuda(non_blocking=True).cpu(), torch.ones(4, 1024))
    taken.close()
    store.close()
    assert not made.registered


def test_a_store_that_does_not_register_locks_nothing():
    store = PinnedStore(register=False)
    store.empty((16,), torch.float32).fill_(2.0)
    store.lock()
    assert not any(b.registered for b in store._buffers.values())
