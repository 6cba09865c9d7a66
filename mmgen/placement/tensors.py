"""A module's weights kept once in host memory, bound to host or device storage on demand.

Inference never writes weights, so parking a module is free: its tensors are re-pointed at the host
copy and the device copy is dropped; nothing is copied back. Tensors that share a storage (the views
fused projections make of one stacked matrix) are moved as one storage and stay views of it.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

HUGE_PAGE_BYTES = 2 << 20  # a buffer of at least this much is advised to use transparent huge pages
LOCK_THREADS = 8  # PinnedStore.lock's threads (the host store's readers are as many)


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
    adopt: a PinnedStore the module was loaded into: a storage that is one of its buffers becomes
    the host copy as it is (taken from the store, closed with this group), nothing copied.
    `adopted` / `copied` count the storages each way.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        pin: bool,
        skip: nn.Module | None = None,
        adopt: PinnedStore | None = None,
    ) -> None:
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
        self.adopted = self.copied = 0
        for index, tensors in enumerate(by_storage.values()):
            storage = tensors[0].untyped_storage()
            taken = None if adopt is None else adopt.take(storage)
            if taken is not None:
                pinned.append(taken)
                host.append(taken.buffer)
                self.adopted += 1
            else:
                if pin:  # registered once the copy has written its pages (see _PinnedBuffer.register)
                    pinned.append(_PinnedBuffer(storage.nbytes(), register=False))
                host.append(_host_copy(storage, pinned[-1].buffer if pin else None))
                if pin:
                    pinned[-1].register()
                self.copied += int(pin or storage.device.type != "cpu")
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
    """uint8 [nbytes] CPU memory of its own pages (an anonymous mapping), page-locked with
    cudaHostRegister when `register` (else by register(), once its pages are written); one per host
    storage.

    Not torch's pinned allocator: that rounds every allocation up to a power of two (a 142 MB FFN
    matrix would take 256 MB); registering a mapping pins exactly its pages, and one buffer per
    storage keeps the host copy of a model growing storage by storage as the source shrinks, never
    a second whole copy. `buffer` is a storage of its own (offset 0, exactly nbytes), so tensors
    laid over it (PinnedStore) are recognised as this buffer by their storage.
    """

    PAGE = mmap.PAGESIZE  # each buffer owns whole pages: two registrations must never share one

    def __init__(self, nbytes: int, *, register: bool = True) -> None:
        pages = max(1, math.ceil(nbytes / self.PAGE)) * self.PAGE
        # Private anonymous pages (fileno -1 maps anonymous memory); the tensor holds the mapping alive.
        self._map = mmap.mmap(-1, pages, flags=mmap.MAP_PRIVATE)
        if pages >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux only)
            # Transparent huge pages where the host allows them on request: a read into the buffer then
            # faults 2 MB at a time, not 4 KB (an H200 host's --offload model load 2.7-2.8 -> 1.9 s,
            # benchmarks/RESULTS.md 31); nothing changes where they are always or never used.
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.buffer = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self.registered = False
        self._unregister = None
        if register:
            self.register()

    def register(self) -> None:
        """Page-lock the buffer's pages (cudaHostRegister); nothing if they are already, or it is empty.

        Pages already written register several times faster than new ones, which cudaHostRegister must
        first fault in and zero itself: H200 hosts page-locked 14.2 GB of new pages in 2.3-5.5 s, the same
        pages in 0.4-1.2 s once eight threads had written them (benchmarks/RESULTS.md 31)."""
        if self.registered or not self.buffer.numel():
            return
        status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), len(self._map), 0)
        _check_cuda(status, "cudaHostRegister")
        self.registered = True
        # A buffer dropped without close() must not return registered pages to the system: a later
        # registration or pinned allocation of the same pages fails ("resource already mapped"). The
        # finalizer runs before the pages are freed (it holds the mapping).
        self._unregister = weakref.finalize(self, _unregister_pages, self.buffer.data_ptr(), self._map)
        self._unregister.atexit = False  # at exit the process's memory goes back anyway

    def close(self) -> None:
        if self.registered:
            self._unregister()
            self.registered = False


def _unregister_pages(pointer: int, mapping: mmap.mmap) -> None:
    del mapping  # held until now so the pages outlive their registration
    _check_cuda(torch.cuda.cudart().cudaHostUnregister(pointer), "cudaHostUnregister")


class PinnedStore:
    """Host buffers a loader fills, one per tensor, for the placement that will offload them.

    empty() gives a tensor over a buffer of its own pages, so a checkpoint tensor is read and cast
    straight into the memory the offload copies to the GPU from; lock() then page-locks every buffer
    made so far (register, default: when CUDA is available), in several threads, once the reads have
    written their pages (faster than registering new pages, _PinnedBuffer.register). The placement's
    TensorGroups take() these buffers (page-locked then, if lock() was not called) instead of copying
    into new ones. close() unregisters what no group took (weights the placement moved to the device,
    or a placement that offloads nothing): their pages go when their tensors go.
    """

    def __init__(self, *, register: bool | None = None) -> None:
        self.register = pin_available() if register is None else register
        self._buffers: dict[int, _PinnedBuffer] = {}
        self.made = 0
        self.taken = 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized CPU tensor of `shape` and `dtype` in a buffer of this store."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(tuple(shape), dtype=dtype)
        buffer = _PinnedBuffer(nbytes, register=False)
        self._buffers[buffer.buffer.data_ptr()] = buffer
        self.made += 1
        return buffer.buffer.view(dtype).view(tuple(shape))

    def lock(self) -> None:
        """Page-lock every buffer made so far (when the store registers), LOCK_THREADS at a time, each
        thread on the calling thread's GPU (a registration belongs to the current device's context)."""
        waiting = [b for b in self._buffers.values() if not b.registered]
        if not self.register or not waiting:
            return
        gpu = torch.cuda.current_device()

        def lock_one(buffer: _PinnedBuffer) -> None:
            with torch.cuda.device(gpu):
                buffer.register()

        with ThreadPoolExecutor(min(LOCK_THREADS, len(waiting))) as pool:
            list(pool.map(lock_one, waiting))

    def take(self, storage: torch.UntypedStorage) -> _PinnedBuffer | None:
        """The buffer that is `storage` (its owner is now the caller), or None."""
        buffer = self._buffers.get(storage.data_ptr())
        if buffer is None or storage.device.type != "cpu" or buffer.buffer.numel() != storage.nbytes():
            return None
        del self._buffers[storage.data_ptr()]
        self.taken += 1
        if self.register:
            buffer.register()
        return buffer

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers not taken yet."""
        return sum(b.buffer.numel() for b in self._buffers.values())

    def close(self) -> None:
        for buffer in self._buffers.values():
            buffer.close()
        self._buffers.clear()


def _check_cuda(status: object, call: str) -> None:
    code = int(status)  # a cudaError enum
    if code != 0:
        raise RuntimeError(f"{call} failed with CUDA error {code}")


def pin_available() -> bool:
    """Page-locked host memory needs a CUDA runtime."""
    return torch.cuda.is_available()


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each shared storage counted once, wherever they live
    (on the meta device too: a structure without weights, load_umt5_encoder(read=False, keep=False))."""
    seen: dict[tuple[bool, int], int] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for tensor in table.values():
                if tensor is not None:
                    storage = tensor.untyped_storage()
                    # meta storages have no address (all 0): a tied weight there is one tensor object
                    key = (True, id(tensor)) if tensor.is_meta else (False, storage.data_ptr())
                    seen[key] = storage.nbytes()
    return sum(seen.values())
