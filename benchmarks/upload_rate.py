"""One question: at what rate does a load read a checkpoint from the page cache into a GPU, and what bounds it?

    python3 benchmarks/upload_rate.py --model DIR --ceilings          # this checkout's mmgen
    PYTHONPATH=/tmp/before python3 benchmarks/upload_rate.py --model DIR   # another checkout's

Per component of a Wan directory (text_encoder, transformer): mmgen.placement.upload.upload of its
tensors in their own dtype (as load_into_module calls it for a bf16 checkpoint loaded in bf16) as a new
process's load does it (the files mapped anew, the page-locked staging buffers allocated anew), reading
what --read says; the page cache warmed by one untimed run, then --runs timed runs: seconds and GB/s. With --ceilings, what the
host gives the same bytes: the allocation of every tensor on the GPU from an emptied cache, the memcpy
from the memory-mapped files into page-locked buffers on 1, 8 and 16 threads (no GPU), and a page-locked
buffer's copy to the GPU. With --reads, how the host reads the files when each run maps them anew (as a
new process does): copies from a fresh memory mapping (page faults) against os.preadv into page-locked
buffers, in 1 process (8 and 16 threads) and in 2 and 4 processes taking every 2nd / 4th piece (8 threads
each; the wall from a barrier to the last one's end). Prints one table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mmgen.loading.safetensors_dir import find_weight_files, read_tensors
from mmgen.placement import upload as upload_module
from mmgen.placement.upload import upload

PIECE = 64 << 20
READS = ("mapping", "preadv")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--components", default="text_encoder,transformer")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ceilings", action="store_true")
    parser.add_argument("--reads", action="store_true", help="fresh reads by method, threads and processes")
    parser.add_argument(
        "--read",
        choices=READS,
        default="mapping",
        help="what upload reads: the memory mapping or the files (os.preadv)",
    )
    args = parser.parse_args()
    import mmgen

    label = str(Path(mmgen.__file__).resolve().parent.parent)[-24:]
    print(f"{'what':<44} {'GB':>6} {'seconds (runs)':>24} {'GB/s':>7}")
    if args.reads:
        _reads(args.model, args.components.split(","), args.runs)
        return
    for component in args.components.split(","):
        weight_files = find_weight_files(args.model / component)
        read = read_tensors(weight_files)
        tensors = {name: t for name, (t, _) in read.items()}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        largest = max(t.numel() * t.element_size() for t in tensors.values())
        workers = upload_module.worker_count(1 << 20)
        what = f"upload {component} ({label}, {args.read}, {workers} workers; largest {largest / 1e9:.2f} GB)"
        _row(what, size, lambda weight_files=weight_files: _upload(weight_files, args.read), args.runs)
        if args.ceilings:
            _row(
                f"allocate {component}'s {len(tensors)} tensors on the GPU",
                size,
                lambda tensors=tensors: _allocate(tensors),
                args.runs,
            )
            for threads in (1, 8, 16):
                _row(
                    f"memcpy {component} to page-locked, {threads} threads",
                    size,
                    lambda threads=threads, tensors=tensors: _memcpy(tensors, threads),
                    args.runs,
                )
    if args.ceilings:
        pinned = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        target = torch.empty_like(pinned, device="cuda")

        def dma() -> float:
            torch.cuda.synchronize()
            tick = time.perf_counter()
            for _ in range(4):
                target.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - tick

        _row("page-locked to GPU, 1 GiB x 4", 4 * pinned.numel(), dma, args.runs)


def _files(read: dict[str, tuple[torch.Tensor, Path]]) -> dict[str, tuple[Path, int]]:
    """Where each tensor's bytes lie (imported here: a tree before upload's `files` lacks tensor_offsets)."""
    from mmgen.loading.safetensors_dir import tensor_offsets

    offsets = {path: tensor_offsets(path) for path in {path for _, path in read.values()}}
    return {name: (path, offsets[path][name]) for name, (_, path) in read.items()}


def _upload(weight_files: list[Path], how: str) -> float:
    """Seconds to upload the files' tensors in their own dtype as a new process's load does: the files
    mapped anew, the page-locked staging buffers allocated anew (the host cache emptied first)."""
    empty_host_cache = getattr(torch._C, "_host_emptyCache", None) or torch._C._accelerator_emptyHostCache
    empty_host_cache()
    torch.cuda.synchronize()
    tick = time.perf_counter()
    read = read_tensors(weight_files)
    tensors = {name: t for name, (t, _) in read.items()}
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if how == "mapping":
        out = upload(tensors, dtypes, "cuda")  # (a tree before upload's `files` has only this)
    else:
        out = upload(tensors, dtypes, "cuda", files=_files(read))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - tick
    del out
    torch.cuda.empty_cache()
    return seconds


def _allocate(tensors: dict[str, torch.Tensor]) -> float:
    """Seconds to allocate every tensor (its own dtype) on the GPU from an emptied cache (upload does this
    in the calling thread before the reads begin: fresh segments from the driver, as in a new process)."""
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    tick = time.perf_counter()
    out = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in tensors.values()]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - tick
    del out
    torch.cuda.empty_cache()
    return seconds


def _memcpy(tensors: dict[str, torch.Tensor], threads: int) -> float:
    """Every tensor's bytes copied into page-locked buffers by `threads` threads taking PIECE-sized pieces."""
    pieces = [
        (t.reshape(-1).view(torch.uint8), start)
        for t in tensors.values()
        for start in range(0, t.numel() * t.element_size(), PIECE)
    ]
    buffers = [
        torch.empty(PIECE, dtype=torch.uint8, pin_memory=torch.cuda.is_available()) for _ in range(threads)
    ]

    def work(index: int) -> None:
        for source, start in pieces[index::threads]:
            part = source[start : start + PIECE]
            buffers[index][: part.numel()].copy_(part)

    tick = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    return time.perf_counter() - tick


def _spans(files: list[Path]) -> list[tuple[Path, str, int, int, int]]:
    """(file, tensor, the tensor's offset in the file, start, end) for every tensor, its bytes cut into
    PIECE-sized spans [start, end) of the tensor's own."""
    from mmgen.loading.safetensors_dir import tensor_offsets

    spans = []
    for path in files:
        offsets = tensor_offsets(path)
        for name, (tensor, _) in read_tensors([path]).items():
            size = tensor.numel() * tensor.element_size()
            spans += [(path, name, offsets[name], s, min(s + PIECE, size)) for s in range(0, size, PIECE)]
    return spans


def _read_spans(spans: list, method: str, threads: int) -> tuple[float, float]:
    """(start, end) on the monotonic clock of reading `spans` into page-locked buffers by `threads`
    threads; "mmap": copies from a new mapping of each file, "pread": os.preadv from each file."""
    buffers = [
        torch.empty(PIECE, dtype=torch.uint8, pin_memory=torch.cuda.is_available()) for _ in range(threads)
    ]
    views = [memoryview(buffer.numpy()) for buffer in buffers]
    files = sorted({path for path, *_ in spans})
    start = time.monotonic()
    if method == "mmap":
        mapped = {
            (path, name): tensor.reshape(-1).view(torch.uint8)
            for name, (tensor, path) in read_tensors(files).items()
        }

        def work(index: int) -> None:
            for path, name, _, s, e in spans[index::threads]:
                buffers[index][: e - s].copy_(mapped[(path, name)][s:e])
    else:
        fds = {path: os.open(path, os.O_RDONLY) for path in files}

        def work(index: int) -> None:
            for path, _, offset, s, e in spans[index::threads]:
                os.preadv(fds[path], [views[index][: e - s]], offset + s)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    end = time.monotonic()
    if method == "pread":
        for fd in fds.values():
            os.close(fd)
    return start, end


def _read_share(spans, method, threads, barrier, results, rank, ranks) -> None:
    torch.empty(1, pin_memory=torch.cuda.is_available())  # CUDA's host allocator up before the barrier
    barrier.wait()
    results.put(_read_spans(spans[rank::ranks], method, threads))


def _reads(model: Path, components: list[str], runs: int) -> None:
    spans = [span for component in components for span in _spans(find_weight_files(model / component))]
    size = sum(e - s for *_, s, e in spans)
    for path in sorted({path for path, *_ in spans}):
        with open(path, "rb") as handle:  # the page cache warm
            while handle.read(1 << 26):
                pass
    context = multiprocessing.get_context("spawn")
    for method in ("mmap", "pread"):
        for ranks, threads in ((1, 8), (1, 16), (2, 8), (4, 8)):

            def once(ranks=ranks, threads=threads, method=method) -> float:
                barrier, results = context.Barrier(ranks), context.Queue()
                workers = [
                    context.Process(
                        target=_read_share, args=(spans, method, threads, barrier, results, rank, ranks)
                    )
                    for rank in range(ranks)
                ]
                for worker in workers:
                    worker.start()
                times = [results.get() for _ in workers]
                for worker in workers:
                    worker.join()
                return max(e for _, e in times) - min(s for s, _ in times)

            _row(f"{method}, {ranks} process(es) x {threads} threads, fresh", size, once, runs)


def _row(what: str, size: int, once, runs: int) -> None:
    once()  # the page cache warm, the pools made
    seconds = [once() for _ in range(runs)]
    median = statistics.median(seconds)
    shown = " / ".join(f"{s:.3f}" for s in seconds)
    print(f"{what:<44} {size / 1e9:6.2f} {shown:>24} {size / median / 1e9:7.1f}", flush=True)


if __name__ == "__main__":
    main()
