"""One question: how long does a new process take to page-lock a host store the size of a model, by method?

    python3 benchmarks/pin_rate.py --model DIR --runs 2        # one GPU host, ~1 min for 14 GB

An offload load (`--offload model`) reads every tensor into a mmgen.placement.PinnedStore: one anonymous
mapping per tensor, page-locked with cudaHostRegister. Each method below runs in a fresh subprocess over
the tensor sizes of DIR's safetensors files (outside vae/), then frees everything:
  serial       every buffer made and registered in one thread (what PinnedStore.empty did in the load)
  threads      the same buffers made and registered by 8 threads at once
  touch_first  8 threads: each buffer made, its pages written (the read would fault them in), then registered
  unpinned     8 threads: the buffers made and their pages written, no registration (the floor)
Prints each run's seconds and GB/s, and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_utils import RESULT, fresh_result

METHODS = ("serial", "threads", "touch_first", "unpinned")
THREADS = 8


def sizes_of(model: Path) -> list[int]:
    from mmgen.loading.safetensors_dir import _tensor_spans

    files = sorted(p for p in model.rglob("*.safetensors") if "vae" not in p.relative_to(model).parts)
    return [end - start for path in files for start, end in _tensor_spans(path).values()]


def one_run(method: str, sizes: list[int]) -> float:
    import torch

    from mmgen.placement.tensors import _PinnedBuffer

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, as a load has it by then

    def make(nbytes: int) -> _PinnedBuffer:
        if method == "serial" or method == "threads":
            return _PinnedBuffer(nbytes)
        buffer = _PinnedBuffer(nbytes, register=False)
        buffer.buffer.fill_(1)  # each page written once, as a read into it does
        if method == "touch_first":
            status = torch.cuda.cudart().cudaHostRegister(buffer.buffer.data_ptr(), len(buffer._map), 0)
            assert int(status) == 0, status
            buffer.registered = True
        return buffer

    began = time.perf_counter()
    if method == "serial":
        buffers = [make(n) for n in sizes]
    else:
        with ThreadPoolExecutor(THREADS) as pool:
            buffers = list(pool.map(make, sizes))
    seconds = time.perf_counter() - began
    for buffer in buffers:
        if buffer.registered:
            torch.cuda.cudart().cudaHostUnregister(buffer.buffer.data_ptr())
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a model directory (cold_start.py --write)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a subprocess's method
    args = parser.parse_args()
    sizes = sizes_of(args.model)
    if args.one:
        print(RESULT + json.dumps(one_run(args.one, sizes)), flush=True)
        return
    total = sum(sizes) / 1e9
    print(f"{len(sizes)} tensors, {total:.2f} GB")
    times: dict[str, list[float]] = {method: [] for method in args.methods}
    for run in range(args.runs):
        for method in args.methods:
            seconds = fresh_result([sys.executable, __file__, "--model", str(args.model), "--one", method])
            if seconds is None:
                continue
            times[method].append(seconds)
            print(f"run {run + 1} {method:12s} {seconds:6.2f} s  {total / seconds:6.1f} GB/s", flush=True)
    print("\nmethod        median s   GB/s")
    for method, values in times.items():
        if values:
            median = statistics.median(values)
            print(f"{method:12s} {median:8.2f} {total / median:6.1f}")


if __name__ == "__main__":
    main()
