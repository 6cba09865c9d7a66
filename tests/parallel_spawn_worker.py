"""A worker for the spawned-world test, importing only torch and mmgen.parallel (fresh interpreters are slow)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mmgen.parallel.layout import ParallelLayout


def world_ranks(layout: ParallelLayout) -> list[int]:
    """Every rank's number, all-gathered over the SP group (a spawned world works end to end)."""
    device = layout.collective_device  # the CPU under gloo, the rank's GPU under NCCL
    ranks = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(layout.sp_degree)]
    dist.all_gather(ranks, torch.tensor([layout.rank], device=device), group=layout.sp_group)
    return [int(r) for r in ranks]


def world_pids(layout: ParallelLayout) -> list[int]:
    """Every rank's process id, all-gathered over the SP group (which processes ran the world)."""
    import os

    device = layout.collective_device
    pids = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(layout.sp_degree)]
    dist.all_gather(pids, torch.tensor([os.getpid()], device=device), group=layout.sp_group)
    return [int(p) for p in pids]


def pending_then_ranks(layout) -> tuple[str, int, list[int]]:
    """Given a layout to settle itself (run_parallel(..., settles=True)): what it was given, its world
    size read before settling, then every rank's number over the settled layout's SP group."""
    from mmgen.parallel.launch import settled

    given, size = type(layout).__name__, layout.world_size
    return given, size, world_ranks(settled(layout))


def early_setup_times(results, early) -> None:
    """A started rank's assignment (StartedRanks.assign): its EarlySetup's rank, error and time stamps."""
    setup = early.result()
    results.put((setup.layout.rank if setup.layout is not None else None, setup.error, setup.times()))


def fails_on(layout, failing: int, how: str) -> list[int]:
    """Rank `failing` fails (how: "raise" an error, "interrupt" (KeyboardInterrupt), "kill" itself with
    SIGKILL, "stop" itself with SIGSTOP: a hung rank) while every other rank waits for it in an all-gather; without a failure, every
    rank's number (world_ranks)."""
    import os
    import signal
    import time

    if layout.rank == failing and how == "raise":
        raise ValueError(f"planted failure on rank {failing}")
    if layout.rank == failing and how == "interrupt":  # as Ctrl-C, which reaches every rank
        raise KeyboardInterrupt
    if layout.rank == failing and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if layout.rank == failing and how == "stop":
        time.sleep(0.2)  # inside the first heartbeat's period (BEAT_S 0.5 s), its first report sent
        os.kill(os.getpid(), signal.SIGSTOP)
    return world_ranks(layout)


def stuck_unless_rank_1_raises(layout) -> None:
    """Rank 1 raises; rank 0 never returns (as rank 0 waiting in an NCCL collective with a failed peer)."""
    import time

    if layout.rank == 1:
        raise ValueError("planted failure on rank 1")
    time.sleep(120)


def launcher_signalled(layout) -> None:
    """Rank 0 (a leading launcher: the command's own process) gets SIGTERM alone mid-run and unwinds through a
    collective (as generate's group link stops), while rank 1 waits in another collective for it."""
    import os
    import signal
    import time

    if layout.rank != 0:
        world_ranks(layout)  # rank 0 never joins this one
        return
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the signal's handler raises here
    finally:
        dist.barrier(group=layout.sp_group)
