"""A module's weights kept once in host memory, bound to host or device storage on demand.

Inference never writes weights, so parking a module is free: its tensors are re-pointed at the host
copy and the device copy is dropped; nothing is copied back. Tensors that share a storage (the views
fused projections make of one stacked matrix) are moved as one storage and stay views of it.
"""

from __future__ import annotations

import weakref
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
        skipped = set() if skip is None else {id(m) for m in skip.modules()}
        by_storage: dict[int, list[torch.Tensor]] = {}
        for owner in module.modules():
            if id(owner) in skipped:
                continue
            for table in (owner._parameters, owner._buffers):
                for tensor in table.values():
                    if tensor is not None:
                        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        host: list[torch.Tensor] = []
        entries: list[_Entry] = []
        host_views: list[torch.Tensor] = []
        pinned: list[_PinnedBuffer] = []
        for index, tensors in enumerate(by_storage.values()):
            storage = tensors[0].untyped_storage()
            if pin:
                pinned.append(_PinnedBuffer(storage.nbytes()))
            host.append(_host_copy(storage, pinned[-1].buffer if pin else None))
            for tensor in tensors:
                entry = _Entry(
                    tensor,
                    index,
                    tensor.storage_offset(),
                    tuple(tensor.shape),
                    tuple(tensor.stride()),
                    tensor.dtype,
                )
                entries.append(entry)
                host_views.append(_as_view(host[index], entry))
                # Rebind at once, so the storage copied from is released before the next is copied:
                # moving a model to the host never holds two copies of more than one storage.
                tensor.data = host_views[-1]
        self._pinned = pinned
        self.host = tuple(host)
        self.entries = tuple(entries)
        self.host_views = tuple(host_views)

    def close(self) -> None:
        """Unregister the pinned host memory (call after the module no longer points at it)."""
        for buffer in self._pinned:
            buffer.close()
        self._pinned = []

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


def _host_copy(storage: torch.UntypedStorage, target: torch.Tensor | None) -> torch.Tensor:
    """uint8 [nbytes] on the CPU holding `storage`'s bytes: `target` (a pinned buffer) filled with
    them, or, without a target, the storage itself when it is on the CPU, else a CPU copy."""
    source = _byte_view(storage)
    if target is None:
        return source if source.device.type == "cpu" else source.cpu()
    target.copy_(source)
    return target


class _PinnedBuffer:
    """uint8 [nbytes] CPU memory page-locked with cudaHostRegister, one per host storage.

    Not torch's pinned allocator: that rounds every allocation up to a power of two (a 142 MB FFN
    matrix would take 256 MB); registering an ordinary allocation pins exactly its bytes, and one
    buffer per storage keeps the host copy of a model growing storage by storage as the source
    shrinks, never a second whole copy.
    """

    PAGE = 4096  # each buffer owns whole pages: two registrations must never share one

    def __init__(self, nbytes: int) -> None:
        pages = -(-nbytes // self.PAGE) * self.PAGE
        raw = torch.empty(pages + self.PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % self.PAGE
        self._pages = raw[start : start + pages]
        self.buffer = self._pages[:nbytes]
        self.registered = False
        self._unregister = None
        if nbytes:
            status = torch.cuda.cudart().cudaHostRegister(self._pages.data_ptr(), pages, 0)
            _check_cuda(status, "cudaHostRegister")
            self.registered = True
            # A buffer dropped without close() must not return registered pages to the allocator: a
            # later registration or pinned allocation of the same pages fails ("resource already
            # mapped"). The finalizer runs before the pages are freed (it holds them alive).
            self._unregister = weakref.finalize(self, _unregister_pages, self._pages)
            self._unregister.atexit = False  # at exit the process's memory goes back anyway

    def close(self) -> None:
        if self.registered:
            self._unregister()
            self.registered = False


def _unregister_pages(pages: torch.Tensor) -> None:
    _check_cuda(torch.cuda.cudart().cudaHostUnregister(pages.data_ptr()), "cudaHostUnregister")


def _check_cuda(status: object, call: str) -> None:
    code = int(status)  # a cudaError enum
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA error {code}")


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
