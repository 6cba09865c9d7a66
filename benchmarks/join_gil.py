"""One question: does a rank's world join (init_process: NCCL's communicator; init_layout: the groups' warm-up),
run in a thread as a leading `generate` runs it beside its load, hold the GIL and so stall the load's thread?

Two spawned ranks on GPUs 0 and 1; in each, a thread joins the world while the main thread runs a pure-Python
loop in 1 ms slices; prints, per rank, the join's seconds, the main thread's slices done during it against
a quiet second's, and its longest gap. Needs 2 GPUs.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch.multiprocessing as mp


def _spin(until: threading.Event) -> tuple[int, float]:
    """1 ms Python slices until `until`: how many, and the longest time between two."""
    count, longest, last = 0, 0.0, time.perf_counter()
    while not until.is_set():
        end = time.perf_counter() + 0.001
        while time.perf_counter() < end:
            pass
        now = time.perf_counter()
        longest, last, count = max(longest, now - last), now, count + 1
    return count, longest


def rank(position: int, address: str, out) -> None:
    import torch

    from mmgen.parallel.launch import init_process
    from mmgen.parallel.layout import ParallelConfig, init_layout

    torch.cuda.set_device(position)
    torch.zeros(1, device="cuda")  # the context first: the question is the join's
    quiet = threading.Event()
    timer = threading.Timer(1.0, quiet.set)
    timer.start()
    base, _ = _spin(quiet)
    done, times = threading.Event(), {}

    def join() -> None:
        began = time.perf_counter()
        device = init_process(position, 2, "cuda", 120.0, address)
        times["process"] = time.perf_counter() - began
        init_layout(ParallelConfig(sp=2), device)
        times["joined"] = time.perf_counter() - began
        done.set()

    began = time.perf_counter()
    thread = threading.Thread(target=join)
    thread.start()
    slices, longest = _spin(done)
    spent = time.perf_counter() - began
    thread.join()
    out.put((position, times, spent, slices, base, longest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args()
    from mmgen.parallel.process import free_port

    context = mp.get_context("spawn")
    out = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    ranks = [context.Process(target=rank, args=(p, address, out)) for p in range(2)]
    for process in ranks:
        process.start()
    rows = sorted(out.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join()
    print(
        "rank  process_s  joined_s  slices_during  expected(quiet rate)  share_of_time_with_GIL  longest_gap_ms"
    )
    for position, times, spent, slices, base, longest in rows:
        expected = base * spent
        print(
            f"{position:<5} {times['process']:9.3f} {times['joined']:9.3f} {slices:14d} {expected:21.0f} "
            f"{slices / expected:23.2f} {longest * 1e3:15.1f}"
        )
    os._exit(0)


if __name__ == "__main__":
    main()
