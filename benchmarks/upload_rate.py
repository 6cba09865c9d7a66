"""One question: at what rate does a load read a checkpoint from the page cache into a GPU, and what bounds it?

    python3 benchmarks/upload_rate.py --model DIR --ceilings          # this checkout's mmgen
    PYTHONPATH=/tmp/before python3 benchmarks/upload_rate.py --model DIR   # another checkout's

Per component of a Wan directory (text_encoder, transformer): mmgen.placement.upload.upload of its
tensors in their own dtype (as load_into_module calls it for a bf16 checkpoint loaded in bf16), the page
cache warmed by one untimed run, then --runs timed runs: seconds and GB/s. With --ceilings, what the
host gives the same bytes: the allocation of every tensor on the GPU from an emptied cache, the memcpy
from the memory-mapped files into page-locked buffers on 1, 8 and 16 threads (no GPU), and a page-locked
buffer's copy to the GPU. Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mmgen.loading.safetensors_dir import find_weight_files, read_tensors
from mmgen.placement.upload import upload

PIECE = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--components", default="text_encoder,transformer")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ceilings", action="store_true")
    args = parser.parse_args()
    import mmgen

    label = str(Path(mmgen.__file__).resolve().parent.parent)[-24:]
    print(f"{'what':<44} {'GB':>6} {'seconds (runs)':>24} {'GB/s':>7}")
    for component in args.components.split(","):
        tensors = {
            name: t for name, (t, _) in read_tensors(find_weight_files(args.model / component)).items()
        }
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        dtypes = {name: t.dtype for name, t in tensors.items()}
        largest = max(t.numel() * t.element_size() for t in tensors.values())

        what = f"upload {component} ({label}; largest {largest / 1e9:.2f} GB)"
        _row(what, size, lambda tensors=tensors, dtypes=dtypes: _upload(tensors, dtypes), args.runs)
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


def _upload(tensors: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]) -> float:
    torch.cuda.synchronize()
    tick = time.perf_counter()
    out = upload(tensors, dtypes, "cuda")
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
    buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]

    def work(index: int) -> None:
        for source, start in pieces[index::threads]:
            part = source[start : start + PIECE]
            buffers[index][: part.numel()].copy_(part)

    tick = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(work, range(threads)))
    return time.perf_counter() - tick


def _row(what: str, size: int, once, runs: int) -> None:
    once()  # the page cache warm, the pools made
    seconds = [once() for _ in range(runs)]
    median = statistics.median(seconds)
    shown = " / ".join(f"{s:.3f}" for s in seconds)
    print(f"{what:<44} {size / 1e9:6.2f} {shown:>24} {size / median / 1e9:7.1f}", flush=True)


if __name__ == "__main__":
    main()
