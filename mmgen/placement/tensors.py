"""A module's weights kept once in host memory, bound to host or device storage on demand.

Inference never writes weights, so parking a module is free: its tensors are re-pointed at the host
copy and the device copy is dropped; nothing is copied back. Tensors that share a storage (the views
fused projections make of one stacked matrix) are moved as one storage and stay views of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, eq=False)
class _Entry:
    """One parameter or buffer: the tensor object and where it lies in its storage."""

    tensor: torch.Tensor
    storage: int  # index into TensorGroup.host
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _as_view(buffer: torch.Tensor, entry: _Entry) -> torch.Tensor:
    """The tensor `entry` describes, laid over a uint8 `buffer` with its storage's bytes."""
    view = torch.empty(0, dtype=entry.dtype, device=buffer.device)
    return view.set_(buffer.untyped_storage(), entry.offset, entry.size, entry.stride)


class TensorGroup:
    """Every parameter and buffer of `module`, with one host copy per distinct storage.

    pin: copy the host storages into page-locked memory (what asynchronous host-to-device copies
    need); otherwise the host copies are the module's current storages when they are on the CPU.
    Creating the group binds the module to its host copies (device memory it held is released).
    skip: submodules left out (their tensors are placed by someone else, e.g. streamed blocks).
    """

    def __init__(self, module: nn.Module, *, pin: bool, skip: nn.Module | None = None) -> None:
        storages: dict[int, int] = {}
        host: list[torch.Tensor] = []
        entries: list[_Entry] = []
        skipped = set() if skip is None else {id(m) for m in skip.modules()}
        for owner in module.modules():
            if id(owner) in skipped:
                continue
            for table in (owner._parameters, owner._buffers):
                for tensor in table.values():
                    if tensor is None:
                        continue
                    storage = tensor.untyped_storage()
                    key = storage.data_ptr()
                    if key not in storages:
                        storages[key] = len(host)
                        host.append(_host_copy(storage, pin))
                    entries.append(
                        _Entry(
                            tensor,
                            storages[key],
                            tensor.storage_offset(),
                            tuple(tensor.shape),
                            tuple(tensor.stride()),
                            tensor.dtype,
                        )
                    )
        self.host = tuple(host)
        self.entries = tuple(entries)
        self.host_views = tuple(_as_view(self.host[e.storage], e) for e in self.entries)
        self.bind(self.host_views)

    @property
    def nbytes(self) -> int:
        return sum(buffer.numel() for buffer in self.host)

    @property
    def signature(self) -> tuple:
        """What two groups must share to use the same device buffers (storage sizes, tensor layouts)."""
        return (
            tuple(buffer.numel() for buffer in self.host),
            tuple((e.storage, e.offset, e.size, e.stride, e.dtype) for e in self.entries),
        )

    def allocate(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Empty uint8 device buffers, one per host storage."""
        return tuple(torch.empty(buffer.numel(), dtype=torch.uint8, device=device) for buffer in self.host)

    def views(self, buffers: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """This group's tensors laid over `buffers` (from allocate() of this group or one of equal signature)."""
        return tuple(_as_view(buffers[e.storage], e) for e in self.entries)

    def copy_to(self, buffers: Sequence[torch.Tensor], *, non_blocking: bool) -> None:
        """Host bytes -> `buffers` (on the current stream; asynchronous from pinned memory when non_blocking)."""
        for source, target in zip(self.host, buffers, strict=True):
            target.copy_(source, non_blocking=non_blocking)

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Point every parameter and buffer at `views` (from views() or host_views)."""
        for entry, view in zip(self.entries, views, strict=True):
            entry.tensor.data = view

    def bind_host(self) -> None:
        self.bind(self.host_views)

    def is_bound_to_host(self) -> bool:
        return all(
            e.tensor.data_ptr() == v.data_ptr() for e, v in zip(self.entries, self.host_views, strict=True)
        )


def _host_copy(storage: torch.UntypedStorage, pin: bool) -> torch.Tensor:
    """uint8 [nbytes] on the CPU holding `storage`'s bytes: the storage itself when it may be, else a copy."""
    source = _byte_view(storage)
    if source.device.type == "cpu" and not pin:
        return source
    copy = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=pin)
    copy.copy_(source)
    return copy


def pin_available() -> bool:
    """Page-locked host memory needs a CUDA runtime."""
    return torch.cuda.is_available()


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each shared storage counted once, wherever they live."""
    seen: dict[int, int] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for tensor in table.values():
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
