"""Checkpoint tensors copied into their target memory by several threads at once.

A safetensors tensor on the CPU is a view of the memory-mapped file: its bytes are read from disk
(or the page cache) only when something copies them. One thread copying tensor after tensor with
`.to("cuda", dtype)` reads at one core's speed, stages through pageable memory (~2 GB/s against
20-50 GB/s from page-locked memory) and, when the dtype changes, casts on the CPU first (an fp32
checkpoint loaded as bf16 makes a whole CPU copy). Here each worker thread reads its tensors in
chunks into its own two page-locked buffers and copies each chunk to the GPU on its own stream while
it reads the next; a tensor whose dtype changes is cast on the GPU after its bytes arrive. torch
releases the GIL inside copy_, so the reads of several threads overlap. A tensor kept in its dtype is
cut into pieces of PIECE_BYTES that any worker may take: one thread reading a large tensor alone (UMT5-
XXL's 2.1 GB embedding, 15% of a Wan2.1-1.3B world's reads) would end long after the others.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

CHUNK_BYTES = 32 << 20  # per staging buffer; two per worker
PIECE_BYTES = 8 * CHUNK_BYTES  # the work one worker takes of a tensor kept in its dtype
MAX_WORKERS = 8

# A worker's item: (name, first byte, end byte) of a tensor's bytes; a tensor cast on the GPU is one item
Item = tuple[str, int, int]


def worker_count(jobs: int) -> int:
    """Threads for `jobs` tensors: one per core up to MAX_WORKERS, never more than the jobs."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1, jobs))


def upload(
    tensors: Mapping[str, torch.Tensor],
    dtypes: Mapping[str, torch.dtype],
    device: str | torch.device,
) -> dict[str, torch.Tensor]:
    """{name: a new tensor on `device` in dtypes[name] holding tensors[name]} (tensors on the CPU).

    On a CUDA device the bytes travel through page-locked staging buffers, several tensors at once;
    on the CPU each tensor is cast (or kept: `.to` returns the same tensor when nothing changes).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return {name: t.to(device=device, dtype=dtypes[name]) for name, t in tensors.items()}
    device = calling_thread_gpu(device)  # (its stream and events would miss the copies on another GPU)
    staged = {name: t for name, t in tensors.items() if t.device.type == "cpu"}
    out = {  # tensors already on a GPU are copied there by torch
        name: t.to(device=device, dtype=dtypes[name]) for name, t in tensors.items() if name not in staged
    }
    out.update({name: torch.empty(t.shape, dtype=dtypes[name], device=device) for name, t in staged.items()})
    items = {item: item[2] - item[1] for item in _items(staged, out)}
    groups = _balanced(items, worker_count(len(items)))
    run_parallel([lambda group=group: _upload_group(group, staged, out, device) for group in groups])
    return {name: out[name] for name in tensors}


def _items(tensors: Mapping[str, torch.Tensor], out: Mapping[str, torch.Tensor]) -> list[Item]:
    """The workers' items: each tensor kept in its dtype cut into pieces of at most PIECE_BYTES (its
    pieces land in disjoint bytes of its result), a tensor cast on the GPU whole (cast once all arrived)."""
    items = []
    for name, tensor in tensors.items():
        size = _nbytes(tensor)
        step = PIECE_BYTES if out[name].dtype == tensor.dtype else max(1, size)
        items.extend((name, start, min(start + step, size)) for start in range(0, size, step))
    return items


def calling_thread_gpu(device: str | torch.device) -> torch.device:
    """A CUDA device with its index: "cuda:N" as named, a bare "cuda" this (calling) thread's current GPU.
    Resolved before work goes to another thread: a new thread's current device is cuda:0, so a bare
    "cuda" there names another GPU than a rank's."""
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def fill(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src) for every (dst, src), several at once (reading memory-mapped weights into host buffers)."""
    groups = _balanced({i: _nbytes(src) for i, (_, src) in enumerate(pairs)}, worker_count(len(pairs)))
    run_parallel([lambda group=group: [pairs[i][0].copy_(pairs[i][1]) for i in group] for group in groups])


def run_parallel(jobs: list[Callable[[], object]]) -> None:
    """Run the jobs on a thread each (one job: in this thread); the first error is raised here."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="mmgen-load") as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def _balanced(sizes: Mapping, count: int) -> list[list]:
    """The keys of {key: bytes} in `count` groups of about equal bytes (largest first, each to the
    lightest group)."""
    groups: list[list] = [[] for _ in range(count)]
    loads = [0] * count
    for key in sorted(sizes, key=lambda k: -sizes[k]):
        lightest = loads.index(min(loads))
        groups[lightest].append(key)
        loads[lightest] += sizes[key]
    return [group for group in groups if group]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _upload_group(
    items: list[Item],
    tensors: Mapping[str, torch.Tensor],
    out: dict[str, torch.Tensor],
    device: torch.device,
) -> None:
    # Two page-locked buffers: the GPU copies one while this thread reads into the other; an event
    # per buffer says when its last copy finished, so the buffer can be refilled.
    stream = torch.cuda.Stream(device)
    buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done: list[torch.cuda.Event | None] = [None, None]
    turn = 0
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for name, first, end in items:
            src = tensors[name].contiguous()
            dst = out[name]
            # Same dtype: straight into the result; else into the checkpoint's dtype, cast on the GPU.
            landing = (
                dst if dst.dtype == src.dtype else torch.empty(src.shape, dtype=src.dtype, device=device)
            )
            source_bytes = src.reshape(-1).view(torch.uint8)
            landing_bytes = landing.reshape(-1).view(torch.uint8)
            for start in range(first, end, CHUNK_BYTES):
                stop = min(start + CHUNK_BYTES, end)
                if done[turn] is not None:
                    done[turn].synchronize()
                staged = buffers[turn][: stop - start]
                staged.copy_(source_bytes[start:stop])  # the read: page cache or disk -> page-locked
                landing_bytes[start:stop].copy_(staged, non_blocking=True)
                done[turn] = torch.cuda.Event()
                done[turn].record(stream)
                turn = 1 - turn
            if landing is not dst:
                dst.copy_(landing)
    stream.synchronize()  # the results are read on other streams, and the buffers are freed now
