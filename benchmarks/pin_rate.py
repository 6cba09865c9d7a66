"""One question: how long does a new process take to page-lock a host store the size of a model, by method?

    python3 benchmarks/pin_rate.py --model DIR --runs 2        # one GPU host, ~1 min for 14 GB

An offload load (`--offload model`) reads every tensor into a mmgen.placement.PinnedStore: one anonymous
mapping per tensor (madvised to transparent huge pages), page-locked with cudaHostRegister. Each method
below runs in a fresh subprocess over the tensor sizes of DIR's safetensors files (outside vae/):
  serial    every buffer made and registered at once, one after another (the load before RESULTS.md 31)
  threads   the same buffers made and registered by 8 threads at once
  store     the load now: PinnedStore.empty for each, their pages written by 8 threads (the reads), lock()
  unpinned  the same without registering (the floor)
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

METHODS = ("serial", "threads", "store", "unpinned")
THREADS = 8


def sizes_of(model: Path) -> list[int]:
    from mmgen.loading.safetensors_dir import _tensor_spans

    files = sorted(p for p in model.rglob("*.safetensors") if "vae" not in p.relative_to(model).parts)
    return [end - start for path in files for start, end in _tensor_spans(path).values()]


def one_run(method: str, sizes: list[int]) -> dict[str, float]:
    import torch

    from mmgen.placement.tensors import PinnedStore, _PinnedBuffer

    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the context, as a load has it by then
    result = {}
    began = time.perf_counter()
    if method in ("serial", "threads"):
        if method == "serial":
            buffers = [_PinnedBuffer(n) for n in sizes]
        else:
            with ThreadPoolExecutor(THREADS) as pool:
                buffers = list(pool.map(_PinnedBuffer, sizes))
        result["seconds"] = time.perf_counter() - began
        for buffer in buffers:
            buffer.close()
        return result
    store = PinnedStore(register=method == "store")
    tensors = [store.empty((n,), torch.uint8) for n in sizes]
    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(lambda t: t.fill_(1), tensors))  # each page written once, as a read into it does
    locking = time.perf_counter()
    store.lock()
    result["seconds"] = time.perf_counter() - began
    result["lock"] = time.perf_counter() - locking
    store.close()
    return result


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
            result = fresh_result([sys.executable, __file__, "--model", str(args.model), "--one", method])
            if result is None:
                continue
            seconds = result["seconds"]
            times[method].append(seconds)
            lock = f"  (lock {result['lock']:.2f} s)" if "lock" in result else ""
            print(
                f"run {run + 1} {method:9s} {seconds:6.2f} s  {total / seconds:6.1f} GB/s{lock}", flush=True
            )
    print("\nmethod        median s   GB/s")
    for method, values in times.items():
        if values:
            median = statistics.median(values)
            print(f"{method:12s} {median:8.2f} {total / median:6.1f}")


if __name__ == "__main__":
    main()
