"""What one rank computes or reads for its whole world, on every rank: the text encoder's output
(from_first_rank) and the transformers' weights (share_weights).

from_first_rank's value is a tree of tensors, tuples, lists and dataclasses with plain leaves (ints,
strings, None). Rank 0 sends the tree's shape first (the structure with each tensor's shape, dtype and
device kind: a few hundred bytes through broadcast_object_list), then each tensor through the collective
on the layout's device, so every rank gets rank 0's exact bits.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from mmgen.errors import LoadError, one_line
from mmgen.parallel.layout import ParallelLayout, reads_for_world

T = TypeVar("T")


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in the tree: its index among the tensors sent, and how to allocate it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_device: bool  # on the rank's collective device (a GPU under NCCL), else on the CPU


def from_first_rank(compute: Callable[[], T], layout: ParallelLayout) -> T:
    """compute() run on rank 0 only, its value on every rank of layout's world (collective: every rank
    calls it, in the same order). Rank 0 gets compute's value itself; the others a copy, its tensors on
    their collective device or on the CPU as rank 0's were. One process: compute().

    When compute raises on rank 0, every rank raises: rank 0 its error, the others a copy of it (else a
    RuntimeError with its line), so the ranks of a group fail the job at the same point, as when each
    computed for itself, and none is left waiting in the next collective (mmgen.executors.group_link)."""
    if layout.is_single:
        return compute()
    group, device, source = _world(layout)
    first = reads_for_world(layout)
    header: list[Any] = [None]
    found: list[tuple[torch.Tensor, _Slot]] = []  # rank 0's tensors, in the order of their slots
    if first:
        try:
            value = compute()
        except Exception as error:
            header[0] = ("error", _portable(error))
            dist.broadcast_object_list(header, src=source, group=group, device=device)
            raise
        skeleton = _mapped(value, lambda leaf: _slot_of(leaf, found))
        header[0] = ("value", (skeleton, [slot for _, slot in found]))
    dist.broadcast_object_list(header, src=source, group=group, device=device)
    kind, content = header[0]
    if kind == "error":
        raise content
    skeleton, slots = content
    received = []
    for slot in slots:
        if first:
            buffer = found[slot.index][0].to(device)
        else:
            buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        # bool travels as its bytes (uint8, the same itemsize): not every backend takes bool
        wire = buffer.view(torch.uint8) if slot.dtype == torch.bool else buffer
        dist.broadcast(wire, src=source, group=group)
        if not first:
            received.append(buffer if slot.on_device else buffer.cpu())
    if first:
        return value
    return _mapped(skeleton, lambda leaf: received[leaf.index] if isinstance(leaf, _Slot) else leaf)


def _world(layout: ParallelLayout) -> tuple[Any, torch.device, int]:
    """The world group of a layout of several ranks, its collective device and its rank 0's global rank."""
    if layout.world_group is None:
        raise ValueError(f"{layout.describe()}: the layout has no world group to share over")
    return layout.world_group, layout.collective_device, dist.get_global_rank(layout.world_group, 0)


def _portable(error: Exception) -> Exception:
    """error itself where it survives pickling (what broadcast_object_list does), else a RuntimeError
    with its line."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any error that does not pickle is sent as its line
        return RuntimeError(f"rank 0: {one_line(error, typed=True)}")
    return error


def _slot_of(leaf: Any, found: list[tuple[torch.Tensor, _Slot]]) -> Any:
    """A tensor's _Slot (the pair appended to `found`); any other leaf as it is."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    slot = _Slot(len(found), tuple(leaf.shape), leaf.dtype, leaf.device.type != "cpu")
    found.append((leaf, slot))
    return slot


def _mapped(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """value's tree (tuples, lists, dataclasses other than _Slot) rebuilt with leaf(x) for every other
    node, depth first in order (a dataclass's fields passed to its constructor: the dataclasses shared
    here have init fields only)."""
    if type(value) in (tuple, list):
        return type(value)(_mapped(item, leaf) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type | _Slot):
        fields = dataclasses.fields(value)
        return type(value)(**{f.name: _mapped(getattr(value, f.name), leaf) for f in fields})
    return leaf(value)


def shares_weights(layout: Any, on_host: bool) -> bool:
    """Whether the ranks split the transformers' reads (SplitReads) and share_weights completes them:
    several ranks and the weights going to the device (offloaded weights are each rank's own host
    copies). layout: a ParallelLayout or a launch.PendingLayout (world_size known before the world is
    joined)."""
    return layout.world_size > 1 and not on_host


def transformer_reads(layout: Any, on_host: bool) -> bool | SplitReads:
    """What a rank's loader reads of each transformer (load_into_module's `read`): all of it in one
    process or with its weights on the host, else its part (SplitReads), share_weights then sending
    every rank the rest."""
    return SplitReads(layout.rank, layout.world_size) if shares_weights(layout, on_host) else True


@dataclass(frozen=True)
class SplitReads:
    """A transformer's host reads split over the ranks of a world whose weights go to the GPUs.

    Rank 0 reads none of it: it alone reads the text encoder (mmgen.parallel.layout.reads_for_world;
    UMT5-XXL is 11.4 GB, more than a Wan2.1-14B's share on 4 GPUs). Ranks 1 ... N - 1 read contiguous runs
    of its tensors (state-dict order) of about equal elements, at the same time as rank 0 reads its
    encoder and each over its own GPU's host link; share_weights then broadcasts each tensor from the
    rank that read it. Measured against rank 0 reading every transformer alone: benchmarks/RESULTS.md 28.
    Called with a module (on the meta device before its load, or loaded: the split depends on names and
    shapes only), the names this rank reads (load_into_module's `read`)."""

    rank: int
    world_size: int

    def readers(self, module: nn.Module) -> list[int]:
        """The rank that reads each of the module's distinct tensors, in _distinct_tensors' order."""
        return self._readers_of(_distinct_tensors(module))

    def _readers_of(self, tensors: list[tuple[str, torch.Tensor]]) -> list[int]:
        """readers() of a module whose _distinct_tensors are `tensors`."""
        sizes = [tensor.numel() for _, tensor in tensors]
        if self.world_size == 1:
            return [0] * len(sizes)
        total, others = sum(sizes), self.world_size - 1
        readers, before = [], 0
        for size in sizes:
            # the rank whose equal part of the elements holds this tensor's middle (integers: every rank
            # computes the same split)
            middle = 2 * before + size
            readers.append(1 + min(others - 1, middle * others // max(1, 2 * total)))
            before += size
        return readers

    def __call__(self, module: nn.Module) -> set[str]:
        """The state-dict names of the tensors this rank reads (a tied tensor under each of its names)."""
        state = module.state_dict(keep_vars=True)  # the module's own tensor objects: a tie is one object
        distinct = _distinct_tensors(module)
        mine = {
            id(state[name])
            for (name, _), reader in zip(distinct, self._readers_of(distinct), strict=True)
            if reader == self.rank
        }
        return {name for name, tensor in state.items() if id(tensor) in mine}


def share_weights(module: nn.Module, layout: ParallelLayout) -> None:
    """Each of the module's parameters and persistent buffers copied in place from the rank that read it
    (SplitReads) into the same module on every other rank of layout's world (collective; one process:
    nothing to do).

    Every rank built the module with the same loader and read its part of the tensors, allocating the
    rest without reading them (mmgen.loading.safetensors_dir.load_into_module(read=SplitReads(...))),
    so one copy of the checkpoint is read from the host instead of one per rank, and the rest crosses
    between the GPUs (NVLink under NCCL). The listing of names, shapes and dtypes is compared first: a
    difference is every rank's LoadError, naming the first differing tensor, before any tensor moves."""
    if layout.is_single:
        return
    group, device, source = _world(layout)
    tensors = _distinct_tensors(module)
    listing = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
    header: list[Any] = [listing if reads_for_world(layout) else None]
    dist.broadcast_object_list(header, src=source, group=group, device=device)
    same = torch.tensor([int(header[0] == listing)], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN, group=group)
    if not same.item():
        first = next((mine for mine, theirs in zip(listing, header[0], strict=False) if mine != theirs), None)
        here = "the same here" if header[0] == listing else f"first difference here: {first}"
        raise LoadError(
            f"{type(module).__name__}: the ranks' modules differ ({len(listing)} tensors here, "
            f"{len(header[0])} on rank 0; {here}): every rank must load the same model"
        )
    readers = SplitReads(layout.rank, layout.world_size)._readers_of(tensors)
    for (_, tensor), reader in zip(tensors, readers, strict=True):
        wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
        dist.broadcast(wire, src=dist.get_global_rank(group, reader), group=group)


def _distinct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's state-dict tensors (parameters, persistent buffers) in its order, a tied tensor once."""
    seen: set[int] = set()
    found = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            found.append((name, tensor.detach()))
    return found
