"""BlockStream's stream ordering, checked on the CPU with simulated streams (issue 18's NaN row).

The simulation keeps a vector clock per stream (compute, side): an operation on one stream
happens before one on the other only through an event the second stream waited for. The checks
are the ones a GPU needs:
- a copy into a slot happens after the compute stream queued everything before the slot's
  allocation (the caching allocator hands out memory freed by kernels queued but not yet run);
- a copy into a slot happens after every block that read the slot before;
- a block runs after the copy of its own weights.
A race on a GPU shows only now and then (the 14B 720p row it broke gave NaN once, after a fresh
placement); here it is an ordering fact, so the test fails every time the order is wrong.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from wan_cases import TINY

from mmgen.attention import select_attention
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanDiT
from mmgen.placement.stream import BlockStream
from mmgen.placement.tensors import TensorGroup

CPU = torch.device("cpu")
COMPUTE, SIDE = 0, 1


class SimulatedStreams:
    """BlockStream's Streams on the CPU: copies run at once, their ordering is checked by vector clocks.

    The test tells it when the compute stream queues work (`compute`, with the storages a block
    reads) and when slots are allocated (`allocated`); `errors` lists every ordering violation.
    """

    def __init__(self) -> None:
        self.clocks = [[0, 0], [0, 0]]  # per stream: how far it knows each stream has run
        self.allocated_at: dict[int, int] = {}  # slot storage -> compute position at allocation
        self.written_at: dict[int, int] = {}  # slot storage -> side position of its last copy
        self.read_at: dict[int, list[int]] = {}  # slot storage -> compute positions of its readers
        self.errors: list[str] = []

    def _tick(self, stream: int) -> tuple[int, int]:
        self.clocks[stream][stream] += 1
        return tuple(self.clocks[stream])

    def _merge(self, stream: int, event: tuple[int, int]) -> None:
        self.clocks[stream] = [max(a, b) for a, b in zip(self.clocks[stream], event, strict=True)]

    def compute_event(self) -> tuple[int, int]:
        return tuple(self.clocks[COMPUTE])

    def compute_waits(self, event: tuple[int, int] | None) -> None:
        if event is None:
            self.errors.append("the compute stream was given no event to wait for")
            return
        self._merge(COMPUTE, event)

    def copy(
        self, group: TensorGroup, buffers: Sequence[torch.Tensor], *, after: tuple[int, int] | None
    ) -> tuple[int, int]:
        if after is not None:
            self._merge(SIDE, after)
        at = self._tick(SIDE)
        for buffer in buffers:
            key = buffer.untyped_storage().data_ptr()
            if at[COMPUTE] < self.allocated_at[key]:
                self.errors.append(
                    f"copy {at[SIDE]} writes a slot before the compute stream reached its allocation "
                    f"(compute op {self.allocated_at[key]}, the copy knows {at[COMPUTE]})"
                )
            for reader in self.read_at.get(key, ()):
                if at[COMPUTE] < reader:
                    self.errors.append(f"copy {at[SIDE]} overwrites a slot compute op {reader} still reads")
            self.written_at[key] = at[SIDE]
        group.copy_to(buffers, non_blocking=False)
        return at

    def compute(self, reads: Sequence[torch.Tensor] = ()) -> None:
        """The compute stream queues kernels reading `reads` (tensors; their storages count)."""
        at = self._tick(COMPUTE)
        for key in {t.untyped_storage().data_ptr() for t in reads}:
            if key in self.written_at and at[SIDE] < self.written_at[key]:
                self.errors.append(
                    f"compute op {at[COMPUTE]} reads a slot before copy {self.written_at[key]}"
                )
            if key in self.allocated_at:
                self.read_at.setdefault(key, []).append(at[COMPUTE])

    def allocated(self, buffers: Sequence[torch.Tensor]) -> None:
        for buffer in buffers:
            self.allocated_at[buffer.untyped_storage().data_ptr()] = self.clocks[COMPUTE][COMPUTE]


@pytest.fixture
def sim(monkeypatch) -> SimulatedStreams:
    """Simulated streams that see every slot allocation (TensorGroup.allocate, as BlockStream calls it)."""
    streams = SimulatedStreams()
    allocate = TensorGroup.allocate

    def noted(group: TensorGroup, device: torch.device) -> tuple[torch.Tensor, ...]:
        buffers = allocate(group, device)
        streams.allocated(buffers)
        return buffers

    monkeypatch.setattr(TensorGroup, "allocate", noted)
    return streams


@pytest.mark.parametrize("ahead", [1, 2])
def test_every_copy_and_block_is_ordered_from_the_first_forward_on(sim, ahead):
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
    expected = [(b.weight.clone(), b.bias.clone()) for b in blocks]
    stream = BlockStream(CPU, ahead=ahead, pin=False, streams=sim)
    stream.add(blocks)
    for _ in range(2):  # the second forward reuses the slots the first allocated
        sim.compute([torch.zeros(1)])  # the model's own kernels before its blocks (embeddings)
        for index, block in enumerate(stream(blocks)):
            assert torch.equal(block.weight, expected[index][0]) and torch.equal(
                block.bias, expected[index][1]
            )
            sim.compute([block.weight, block.bias])
    assert sim.errors == []
    assert len(sim.allocated_at) == 2 * (ahead + 1)  # slots allocated once: weight and bias per slot


def test_layer_offloaded_dit_runs_every_block_after_its_copy(sim):
    """The benchmark's failing case: the first forward after a placement, CFG as one batch of two."""
    torch.manual_seed(0)
    resident = WanDiT(TINY).eval().requires_grad_(False)
    for p in resident.parameters():
        p.normal_(0, 0.2)
    streamed = copy.deepcopy(resident)
    stream = BlockStream(CPU, pin=False, streams=sim)
    stream.add(streamed.blocks)
    # The embeddings queue kernels before the first block; each block queues kernels reading its slot.
    streamed.patch_embedding.register_forward_pre_hook(lambda module, args: sim.compute())
    for block in streamed.blocks:
        block.register_forward_pre_hook(lambda module, args: sim.compute(list(module.parameters())))
    g = torch.Generator().manual_seed(7)
    x, t, text = (
        torch.randn(2, 4, 2, 4, 4, generator=g),
        torch.tensor([900.0, 900.0]),
        torch.randn(2, 16, 32, generator=g),
    )
    attention = select_attention("sdpa", device=CPU, dtype=torch.float32, head_dim=16)
    expected = resident(x, t, text, attention=attention)
    for _ in range(2):
        out = streamed(x, t, text, attention=attention, settings=ExecutionSettings(block_stream=stream))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert sim.errors == []


def test_a_forward_left_early_makes_the_compute_stream_wait_for_its_copies(sim):
    blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
    stream = BlockStream(CPU, ahead=2, pin=False, streams=sim)
    stream.add(blocks)
    with pytest.raises(RuntimeError, match="block 1 failed"):
        for index, block in enumerate(stream(blocks)):
            sim.compute([block.weight, block.bias])
            if index == 1:
                raise RuntimeError("block 1 failed")
    # Blocks 2 and 3 were being copied when block 1 failed: freeing the slots (on the compute
    # stream) must come after those copies.
    assert sim.clocks[COMPUTE][SIDE] == sim.clocks[SIDE][SIDE] == 4
    assert sim.errors == []
    assert all(g.is_bound_to_host() for g in stream._groups.values())
