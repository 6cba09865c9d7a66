"""Checkpoint tensors copied into their target memory by several threads at once.

A safetensors tensor on the CPU is a view of the memory-mapped file: its bytes are read from disk
(or the page cache) only when something copies them. One thread copying tensor after tensor with
`.to("cuda", dtype)` reads at one core's speed, stages through pageable memory (~2 GB/s against
20-50 GB/s from page-locked memory) and, when the dtype changes, casts on the CPU first (an fp32
checkpoint loaded as bf16 makes a whole CPU copy). Here each worker thread reads its tensors in
chunks into its own two page-locked buffers and copies each chunk to the GPU on its own stream while
it reads the next; a tensor whose dtype changes is cast on the GPU after its bytes arrive. torch
releases the GIL inside copy_, so the reads of several threads overlap. The work is cut into pieces
of about PIECE_BYTES (small tensors grouped, a large one cut: UMT5-XXL's 2.1 GB embedding is 15% of a
Wan2.1-1.3B world's reads) that each worker takes as it finishes the last, so the threads end together;
the processes of a world can take them from one another's list too (`claims`: each reads a part of
the load and sends it to the others, mmgen.parallel.share.SplitReads).

Where the caller says where each tensor's bytes lie in its file (`files`), a worker reads them with
os.preadv straight into its buffer: a new process's copies from a fresh memory mapping take a page fault
per few pages (on an H200, Wan2.1-1.3B + UMT5-XXL uploaded in 0.94 s that way, in 0.59 s with preadv;
benchmarks/RESULTS.md 30). A buffer takes the spans of consecutive small tensors one after another, with
one event per buffer, not per tensor (a Wan2.1-1.3B DiT has 825). A tensor cast on the CPU (a host
store's) is cast from its mapping, with no whole copy of it first.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mmgen.errors import LoadError

# per staging buffer, two per worker: page-locking memory is slow (a new process's 16 x 32 MB took ~0.2 s
# of a Wan2.1-1.3B DiT's 0.4 s upload, py-spy on an H200) and a read of 8 MB is as fast as one of 32
CHUNK_BYTES = 8 << 20
PIECE_BYTES = 256 << 20  # a piece's size (a worker's unit of work) at most (a group may end past it)
# a smaller load is cut into this many pieces (of MIN_PIECE_BYTES at least), so that its workers (and a
# world's ranks) still share it: a Wan2.1-1.3B DiT's 2.8 GB in 44 MB pieces
MIN_PIECES = 64
MIN_PIECE_BYTES = 4096
MAX_WORKERS = 8

# A tensor's bytes [start, end) to read; end -1: the whole tensor, cast on its device once all arrived
Span = tuple[str, int, int]
# A worker's unit of work: consecutive tensors kept in their dtype grouped up to the load's piece size, a
# larger one cut into parts of it, a tensor cast on the device whole
Piece = tuple[Span, ...]
# Which pieces this process reads: given the pieces (the same list in every process of a world) and
# their bytes, a thread-safe function each worker calls for its next piece's index (None: none left)
Claim = Callable[[], int | None]
Claims = Callable[[list[Piece], list[int]], Claim]
# Where a tensor's bytes lie: its file and the offset of its first byte there (safetensors: contiguous)
FileBytes = tuple[Path, int]
# A result's memory from its shape and dtype
Allocate = Callable[[torch.Size, torch.dtype], torch.Tensor]


def worker_count(jobs: int) -> int:
    """Threads for `jobs` pieces: one per core up to MAX_WORKERS, never more than the jobs."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1, jobs))


def upload(
    tensors: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    device: str | torch.device,
    claims: Claims | None = None,
    allocate_all: bool = True,
    files: Mapping[str, FileBytes] | None = None,
    allocate: Allocate | None = None,
) -> dict[str, torch.Tensor]:
    """{name: a new tensor on `device` in dtypes[name] holding tensors[name]} (tensors on the CPU).

    On a CUDA device the bytes travel through page-locked staging buffers, several pieces at once, the
    worker threads taking the next piece as they finish one; on the CPU, with every piece read here,
    each tensor is cast (or kept: `.to` returns the same tensor when nothing changes).
    claims: the pieces (read_pieces) this process reads, of a load several processes share
    (mmgen.parallel.share.SplitReads); the others' bytes are left unread. allocate_all: every tensor
    allocated (what this process does not read is filled by another); False: only those it reads a
    piece of (it sends them to the one that keeps them). files: {name: (file, offset)} for tensors whose
    bytes are read from their file (os.preadv) rather than copied from the tensor's mapping.
    allocate: makes each result from (shape, dtype) instead of torch.empty on `device` (a PinnedStore's
    page-locked host memory, on the CPU: then every tensor is read there, none kept as it is).
    """
    device = torch.device(device)
    if claims is None and allocate is None and device.type != "cuda":
        return {name: t.to(device=device, dtype=dtypes[name]) for name, t in tensors.items()}
    if device.type == "cuda":
        device = calling_thread_gpu(device)  # (its stream and events would miss the copies on another GPU)
    staged = {name: t for name, t in tensors.items() if t.device.type != "cuda"}
    out = {  # tensors already on a GPU are copied there by torch
        name: t.to(device=device, dtype=dtypes[name]) for name, t in tensors.items() if name not in staged
    }
    allocate = allocate or (lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
    if allocate_all:
        out.update({name: allocate(t.shape, dtypes[name]) for name, t in staged.items()})
    pieces = read_pieces(staged, dtypes)
    claim = (claims or _every)(pieces, [piece_bytes(piece, staged) for piece in pieces])
    with _Target(staged, dtypes, out, device, files or {}, allocate) as target:
        run_parallel([lambda: _read(claim, pieces, target) for _ in range(worker_count(len(pieces)))])
    return {name: out[name] for name in tensors if name in out}


def read_pieces(tensors: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]) -> list[Piece]:
    """The pieces of a load of `tensors` (in their order) into `dtypes`; the same in every process."""
    total = sum(_nbytes(tensor) for tensor in tensors.values())
    limit = min(PIECE_BYTES, max(MIN_PIECE_BYTES, total // MIN_PIECES))
    pieces: list[Piece] = []
    group: list[Span] = []
    size = 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor)
        if dtypes[name] != tensor.dtype:
            pieces.append(((name, 0, -1),))
            continue
        for start in range(0, nbytes, limit):
            end = min(start + limit, nbytes)
            group.append((name, start, end))
            size += end - start
            if size >= limit:
                pieces.append(tuple(group))
                group, size = [], 0
    if group:
        pieces.append(tuple(group))
    return pieces


def piece_bytes(piece: Piece, tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes a piece reads (of `tensors`, the checkpoint's)."""
    return sum(_nbytes(tensors[name]) if end < 0 else end - start for name, start, end in piece)


def _every(pieces: list[Piece], sizes: list[int]) -> Claim:
    """Every piece, in order, to whichever worker asks first (one process reads the whole load)."""
    taken = iter(range(len(pieces)))
    lock = threading.Lock()

    def claim() -> int | None:
        with lock:
            return next(taken, None)

    return claim


class _Target:
    """What the workers read (the checkpoint's tensors, or their files' bytes) and where their pieces land:
    the results (made here on first use when not allocated up front). A context: the files are open
    inside it."""

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        dtypes: Mapping[str, torch.dtype],
        out: dict[str, torch.Tensor],
        device: torch.device,
        files: Mapping[str, FileBytes],
        allocate: Allocate,
    ) -> None:
        self.tensors, self.dtypes, self.out, self.device, self.files = tensors, dtypes, out, device, files
        self._allocate = allocate
        self._lock = threading.Lock()
        self._descriptors: dict[Path, int] = {}

    def __enter__(self) -> _Target:
        for path in {self.files[name][0] for name in self.tensors if name in self.files}:
            try:
                self._descriptors[path] = os.open(path, os.O_RDONLY)
            except OSError as err:
                self.__exit__()  # (not called when __enter__ raises) the files opened so far
                raise LoadError(f"{path}: cannot be opened to read its tensors ({err})") from err
        return self

    def __exit__(self, *exc: object) -> None:
        for descriptor in self._descriptors.values():
            os.close(descriptor)

    def result(self, name: str) -> torch.Tensor:
        with self._lock:
            if name not in self.out:
                self.out[name] = self._allocate(self.tensors[name].shape, self.dtypes[name])
            return self.out[name]

    def read(self, name: str, start: int, stop: int, into: torch.Tensor) -> None:
        """Bytes [start, stop) of tensor `name` (in the checkpoint's dtype) into `into`, a CPU uint8 tensor."""
        if name not in self.files:
            into.copy_(tensor_bytes(self.tensors[name])[start:stop])
            return
        path, offset = self.files[name]
        view = memoryview(into.numpy())
        done = 0
        while done < stop - start:  # preadv may return fewer bytes than asked
            got = os.preadv(self._descriptors[path], [view[done:]], offset + start + done)
            if got == 0:
                raise LoadError(f"{path}: the file ends inside tensor {name!r}")
            done += got


def calling_thread_gpu(device: str | torch.device) -> torch.device:
    """A CUDA device with its index: "cuda:N" as named, a bare "cuda" this (calling) thread's current GPU.
    Resolved before work goes to another thread: a new thread's current device is cuda:0, so a bare
    "cuda" there names another GPU than a rank's."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def run_parallel(jobs: list[Callable[[], object]]) -> None:
    """Run the jobs on a thread each (one job: in this thread); the first error is raised here."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="mmgen-load") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (any dtype, bool too)."""
    return tensor.reshape(-1).view(torch.uint8)


def _read(claim: Claim, pieces: list[Piece], target: _Target) -> None:
    """One worker: the pieces `claim` gives it, read into their results (on a GPU through its own two
    page-locked buffers: the GPU copies from one while this thread reads into the other; a buffer takes
    spans one after another until the next does not fit, then an event says when its copies finished,
    so it can be refilled)."""
    device = target.device
    if device.type != "cuda":
        while (index := claim()) is not None:
            for name, start, end in pieces[index]:
                dst = target.result(name)
                if end < 0:  # the cast .to would make, from the mapping: no whole-tensor copy before it
                    dst.copy_(target.tensors[name])
                else:
                    target.read(name, start, end, tensor_bytes(dst)[start:end])
        return
    stream = torch.cuda.Stream(device)
    buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    turn, used = 0, 0
    with torch.cuda.device(device), torch.cuda.stream(stream):
        while (index := claim()) is not None:
            for name, first, end in pieces[index]:
                src, dst = target.tensors[name], target.result(name)
                # Same dtype: straight into the result; else into the checkpoint's dtype, cast on the GPU.
                landing = dst if end >= 0 else torch.empty(src.shape, dtype=src.dtype, device=device)
                landing_bytes = tensor_bytes(landing)
                last = end if end >= 0 else landing_bytes.numel()
                for start in range(first, last, CHUNK_BYTES):
                    stop = min(start + CHUNK_BYTES, last)
                    if used + stop - start > CHUNK_BYTES:
                        # this buffer is full: an event after its copies, and the other buffer's turn
                        done[turn] = torch.cuda.Event()
                        done[turn].record(stream)
                        turn, used = 1 - turn, 0
                        if done[turn] is not None:
                            done[turn].synchronize()
                    staged = buffers[turn][used : used + stop - start]
                    target.read(name, start, stop, staged)  # page cache or disk -> page-locked
                    landing_bytes[start:stop].copy_(staged, non_blocking=True)
                    used += stop - start
                if landing is not dst:
                    dst.copy_(landing)
    stream.synchronize()  # the results are read on other streams, and the buffers are freed now
