"""One rank's value on every rank of its world: what one rank computes for all (the text encoder's output).

The value is a tree of tensors, tuples, lists and dataclasses with plain leaves (ints, strings, None).
Rank 0 sends the tree's shape first (the structure with each tensor's shape, dtype and device kind:
a few hundred bytes through broadcast_object_list), then each tensor through the collective on the
layout's device, so every rank gets rank 0's exact bits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mmgen.parallel.layout import ParallelLayout

T = TypeVar("T")


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in the tree: its index among the tensors sent, and how to allocate it."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_device: bool  # on the rank's collective device (a GPU under NCCL), else on the CPU


def from_first_rank(value: T | None, layout: ParallelLayout) -> T:
    """Rank 0's `value` on every rank of layout's world (collective: every rank calls it, in the same
    order). Rank 0 passes its value (returned as it is); the others pass None and get a copy, tensors
    on their collective device or on the CPU as rank 0's were. One process: `value` as it is."""
    if layout.is_single:
        return value  # type: ignore[return-value]
    if layout.world_group is None:
        raise ValueError("from_first_rank: the layout has no world group to share over")
    group, device = layout.world_group, layout.collective_device
    source = dist.get_global_rank(group, 0)
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(value, tensors) if layout.rank == 0 else None
    header: list[Any] = [(skeleton, [_slot(i, t) for i, t in enumerate(tensors)])]
    dist.broadcast_object_list(header, src=source, group=group, device=device)
    skeleton, slots = header[0]
    received = []
    for slot in slots:
        if layout.rank == 0:
            buffer = tensors[slot.index].to(device)
        else:
            buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        # bool travels as its bytes (uint8, the same itemsize): not every backend takes bool
        wire = buffer.view(torch.uint8) if slot.dtype == torch.bool else buffer
        dist.broadcast(wire, src=source, group=group)
        received.append(buffer if slot.on_device else buffer.cpu())
    if layout.rank == 0:
        return value  # type: ignore[return-value]
    return _filled(skeleton, received)


def _skeleton(value: Any, tensors: list[torch.Tensor]) -> Any:
    """value with each tensor replaced by its _Slot (the tensor appended to `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _slot(len(tensors) - 1, value)
    if type(value) in (tuple, list):
        return type(value)(_skeleton(item, tensors) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _rebuilt(value, lambda item: _skeleton(item, tensors))
    return value


def _slot(index: int, tensor: torch.Tensor) -> _Slot:
    return _Slot(index, tuple(tensor.shape), tensor.dtype, tensor.device.type != "cpu")


def _filled(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """skeleton with each _Slot replaced by its received tensor."""
    if isinstance(skeleton, _Slot):
        return tensors[skeleton.index]
    if type(skeleton) in (tuple, list):
        return type(skeleton)(_filled(item, tensors) for item in skeleton)
    if dataclasses.is_dataclass(skeleton) and not isinstance(skeleton, type):
        return _rebuilt(skeleton, lambda item: _filled(item, tensors))
    return skeleton


def _rebuilt(value: Any, convert: Any) -> Any:
    """A dataclass instance of value's type with every field converted (its init fields passed to it)."""
    return type(value)(**{f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)})
