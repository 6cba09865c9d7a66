"""Rank 0 in the launcher's own process: `mmgen generate --gpus N` as one GPU's process and N - 1 helpers.

With every rank a spawned process, `generate --gpus 2` ran three processes: the launcher (the parse and
the request's checks, which import torch and the request) and two ranks importing the same beside it;
rank 0 began only once the launcher handed it the work, and the command ended only once the launcher
had rank 0's result and every rank's exit. Measured on 2x H200 (benchmarks/RESULTS.md 24) that was
0.3-1.2 s over one GPU, in rank 0's start (the slowest of three imports, then the hand-off) and its
exit. When the launcher leads (standby.StartedRanks(end_stuck=...)) it is rank 0 itself, as one GPU's
command is its own only rank: its imports and parse are rank 0's, ranks 1 ... N - 1 are the started
processes (their world joined from their start), and `run_led`
- joins that world from this process (a thread begun once the command is parsed, StartedRanks.join_here:
  beside the rest of its start and rank 0's first work, its load, when `settles`),
- runs rank 0's part in this thread and watches the other ranks in another (rank_watch.collect): a
  rank's error, exit or silence ends the run with one RankFailed naming it, as a spawned world's does,
- returns rank 0's value as it is (no pickling) once every other rank reported.
A failed rank leaves rank 0 waiting in a collective; gloo's ends at once (the peer's connection
closed), NCCL's only at its timeout. So when rank 0 has not returned STOP_GRACE_S after another rank's
failure (its peers killed by then), the watcher calls end_stuck(failure), which ends the process with
the failure's line (the group's Ctrl-C or SIGTERM: the command's interrupt): a leading launcher ends
when its run ends, and its world is never torn down (the process's exit does that). Measured (RESULTS.md 25): rank 0 now starts as one GPU's command does,
and at Wan2.1-14B two GPUs take one GPU's time; at 1.3B NCCL's own set-up outlasts the load it hides behind.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mmgen.errors import Terminated, one_line
from mmgen.parallel.launch import World, hand_over, started_layout
from mmgen.parallel.layout import ParallelConfig
from mmgen.parallel.process import DEFAULT_TIMEOUT_S
from mmgen.parallel.rank_watch import STOP_GRACE_S, RankFailed, collect, killed_first, stop

# How long rank 0's own error waits for another rank's failure to be seen: the other's report is
# queued before its exit closes the connections whose loss raised rank 0's error, and the watcher
# reads the queue every 0.1 s (0.2 s more for a report behind an exit), so that one is the cause.
CAUSE_WAIT_S = 0.5


def run_led(
    fn: Callable[..., Any],
    config: ParallelConfig,
    args: tuple,
    *,
    started: Any,
    device_type: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    settles: bool = False,
) -> Any:
    """fn(layout, *args) on every rank of `config`, rank 0 in this thread; rank 0's value, or RankFailed.

    started: a leading StartedRanks (this process its rank 0) that fits config (started.fits).
    settles: fn gets a PendingLayout and settles it itself (mmgen.parallel.launch.settled), so this
    process's join overlaps its first work; else the joined layout."""
    world = World(0, config, device_type, started.world.address, timeout_s, 0, settles)
    places = [(0, rank) for rank in range(1, config.world_size)]
    hand_over(started, [(rank, (world, rank)) for _, rank in places], fn, args, 1)
    setup = started.join_here()  # begun when the command was parsed, or now
    watch = _Watch(started, places)
    try:
        with _others_stopped_first(started.processes, watch):
            value = fn(started_layout(world, 0, setup), *args)
    except Exception as error:
        if watch.interrupt is not None:  # raised while unwinding this process's interrupt (a peer gone)
            raise watch.interrupt from None
        # another rank failed (or was interrupted) first: rank 0's error followed from it
        if watch.failed.wait(CAUSE_WAIT_S):
            raise watch.failure from None
        failure = killed_first(f"rank 0 failed: {one_line(error, typed=True)}", started.processes, places, 1)
        stop(started.processes, grace_s=0.0)  # (named before: stopped, they would be "killed")
        raise failure from None
    except BaseException:  # an interrupt: the others have nothing left to finish
        stop(started.processes, grace_s=0.0)
        raise
    finally:
        watch.rank0_done.set()
        # the others' reports (or, after a failure, their ends: stopped by then, seen within ~0.3 s);
        # the watcher then holds no frame on the ranks' queue, which is freed at close, not leaked
        watch.join()
    if watch.failure is not None:
        raise watch.failure
    return value


@contextlib.contextmanager
def _others_stopped_first(processes: list, watch: _Watch) -> Iterator[None]:
    """While rank 0 runs in this (main) thread: a SIGINT or SIGTERM to this process alone (`kill PID`, a
    container's stop) stops the other ranks first, then raises as the handler before it would
    (KeyboardInterrupt, the CLI's Terminated; Terminated where SIGTERM had no handler), kept for the
    watcher. Else this process's unwinding (a group link's stop: a collective) would wait for ranks
    still in their step, up to the collective's timeout."""
    if threading.current_thread() is not threading.main_thread():  # signals are set from there only
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        prior = previous[signum]
        if prior == signal.SIG_IGN:
            return
        try:
            if callable(prior):
                prior(signum, frame)
                return  # the handler before chose not to interrupt
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated  # the default's place
        except KeyboardInterrupt as interrupt:
            watch.interrupted_by(interrupt)
            stop(processes, grace_s=0.0)
            raise

    for signum in previous:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, prior in previous.items():
            signal.signal(signum, prior)


def _group_signal(processes: list) -> KeyboardInterrupt | None:
    """KeyboardInterrupt / Terminated when a rank was ended by SIGINT / SIGTERM before this launcher stopped
    any: the signal went to the whole group (Ctrl-C, `timeout`, a scheduler), this process too, whose
    own handler may not have run yet (its thread waiting in a collective with that rank)."""
    ends = {process.exitcode for process in processes}
    if -signal.SIGINT in ends:
        return KeyboardInterrupt()
    return Terminated() if -signal.SIGTERM in ends else None


class _Watch:
    """The other ranks of a led world, read in a thread while rank 0 runs: `failure` (a RankFailed, or
    the command's interrupt) set and `failed` set at the first failure, the others then stopped, and
    started.end_stuck called with it when rank 0 has not returned STOP_GRACE_S later."""

    def __init__(self, started: Any, places: list[tuple[int, int]]) -> None:
        self.failure: RankFailed | KeyboardInterrupt | None = None
        # this process's own SIGINT / SIGTERM (_others_stopped_first): what any failure seen after it is
        self.interrupt: KeyboardInterrupt | None = None
        self.failed = threading.Event()
        self.rank0_done = threading.Event()
        self._started = started
        self._thread = threading.Thread(
            target=self._run, args=(places,), name="mmgen-watch-ranks", daemon=True
        )
        self._thread.start()

    def _run(self, places: list[tuple[int, int]]) -> None:
        processes = self._started.processes
        try:
            collect(processes, places, self._started.results, 1)
        except (RankFailed, KeyboardInterrupt) as failure:  # KeyboardInterrupt: a rank's Ctrl-C (rank_watch)
            # without collect's frames, which hold the ranks' queue (freed at the exit, not leaked)
            self.failure = self.interrupt or _group_signal(processes) or failure.with_traceback(None)
            self.failed.set()
            stop(processes, grace_s=0.0)  # rank 0's collective with them now fails (gloo) or waits (NCCL)
            if not self.rank0_done.wait(STOP_GRACE_S):
                # the ranks' queue freed first: end_stuck's os._exit runs no finalizer, and
                # multiprocessing's resource tracker then reported its semaphores as leaked
                self._started.close(wait=False)
                self._started.end_stuck(self.failure)

    def interrupted_by(self, interrupt: KeyboardInterrupt) -> None:
        """This process's own SIGINT / SIGTERM: what any failure seen from now on is."""
        self.interrupt = interrupt

    def join(self) -> None:
        """Once every other rank reported (or failed)."""
        self._thread.join()
