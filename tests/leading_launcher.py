"""A leading launcher (mmgen.parallel.lead: this process is rank 0) run as its own process, for
tests/test_parallel_lead.py: `python tests/leading_launcher.py CASE [cpu|cuda]` prints one JSON line (what rank 0
got, this process's and the started processes' ids), the run's failure as "failed: LINE", "interrupted" or "terminated",
and exits 0;
a run ended by end_stuck prints "stuck: LINE" and exits 3. A process of its own because a leading
launcher joins its world in its own process (torch.distributed's default group) and, when stuck,
ends it."""

from __future__ import annotations

import json
import os
import sys
import time

import parallel_spawn_worker

CASES = {
    "pids": (parallel_spawn_worker.world_pids, ()),
    # as `mmgen generate` ends: the started rank still alive after its report, then this process's os._exit
    "ends first": (parallel_spawn_worker.world_pids, ()),
    "settles": (parallel_spawn_worker.pending_then_ranks, ()),
    "rank 1 raises": (parallel_spawn_worker.fails_on, (1, "raise")),
    "rank 1 is killed": (parallel_spawn_worker.fails_on, (1, "kill")),
    "rank 1 hangs": (parallel_spawn_worker.fails_on, (1, "stop")),
    "rank 1 is interrupted": (parallel_spawn_worker.fails_on, (1, "interrupt")),
    "the launcher alone gets SIGTERM": (parallel_spawn_worker.launcher_signalled, ()),
    "rank 0 raises": (parallel_spawn_worker.fails_on, (0, "raise")),
    "rank 0 is stuck": (parallel_spawn_worker.stuck_unless_rank_1_raises, ()),
}


def end_stuck(error: Exception) -> None:
    print(f"stuck: {error}", flush=True)
    os._exit(3)


def main(case: str, device_type: str) -> None:
    from mmgen.errors import Terminated
    from mmgen.parallel.layout import ParallelConfig
    from mmgen.parallel.lead import run_led
    from mmgen.parallel.process import DEFAULT_TIMEOUT_S, free_port
    from mmgen.parallel.rank_watch import RankFailed
    from mmgen.parallel.standby import EarlyWorld, StartedRanks

    fn, args = CASES[case]
    settles = case == "settles"  # fn gets a PendingLayout to settle itself (as generate's load does)
    world = EarlyWorld(2, None, 1, False, f"tcp://127.0.0.1:{free_port()}", DEFAULT_TIMEOUT_S)
    preload = ("torch", "mmgen.parallel.launch", "parallel_spawn_worker")
    with StartedRanks(2, preload, device=device_type, world=world, end_stuck=end_stuck) as started:
        others = [process.pid for process in started.processes]
        try:
            value = run_led(
                fn, ParallelConfig(sp=2), args, started=started, device_type=device_type, settles=settles
            )
        except RankFailed as failure:
            print(f"failed: {failure}", flush=True)
            return
        except KeyboardInterrupt as interrupt:  # a rank's Ctrl-C, or the launcher's own signal
            print("terminated" if isinstance(interrupt, Terminated) else "interrupted", flush=True)
            return
        if case == "ends first":
            time.sleep(0.5)  # time enough for a rank that ended at its report to be gone
            alive = [process.is_alive() for process in started.processes]
    if case == "ends first":
        print(json.dumps({"others": others, "alive": alive}), flush=True)
        os._exit(0)  # as the console's generate ends: no interpreter teardown, no multiprocessing join
    print(json.dumps({"value": value, "me": os.getpid(), "others": others}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
