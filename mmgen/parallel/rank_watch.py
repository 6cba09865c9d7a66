"""A launcher watching its rank processes: their reports, heartbeats and exits, and stopping them.

Each rank (mmgen.parallel.launch.run_rank) puts its messages on one queue: ("alive", world, rank)
every BEAT_S, then ("ok", world, rank, pickled value or None), ("error", world, rank, line, traceback) or
("interrupted", world, rank). `collect` reads them until every watched rank reported: a rank's error, a
rank killed or exited without a report, or a rank silent for LIVENESS_S after its first beat is one
RankFailed naming it; a rank interrupted (Ctrl-C reaches the terminal's whole group, the launcher too)
is the launcher's KeyboardInterrupt, not a rank's failure; `stop` ends processes. Imports nothing heavy
(no torch).
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import time
from typing import Any

from mmgen.errors import MmgenError

STOP_GRACE_S = 2.0
BEAT_S = 0.5  # each rank's heartbeat to the launcher (a thread: it beats while the rank computes)
LIVENESS_S = 5.0  # a rank silent this long (after its first beat) is hung or stopped: the run fails


class RankFailed(MmgenError):
    """One rank of a parallel run failed; the message names it and its error (one line)."""


def where(index: int, rank: int, count: int) -> str:
    """How a message names rank `rank` of world `index` among `count` worlds."""
    return f"rank {rank}" if count == 1 else f"group {index} rank {rank}"


def killed_first(failed: str, processes: list, places: list[tuple[int, int]], count: int) -> RankFailed:
    """RankFailed for `failed` (a rank's failure, said): a rank killed by a signal makes its peers fail
    in their next collective (gloo: connection closed; NCCL: the timeout), so a killed rank is the
    cause, named first. places[i]: (world, rank) of processes[i]."""
    for process, (index, rank) in zip(processes, places, strict=True):
        if process.exitcode is not None and process.exitcode < 0:
            return RankFailed(
                f"{where(index, rank, count)} was killed (signal {-process.exitcode}); then {failed}"
            )
    return RankFailed(failed)


def collect(processes: list, places: list[tuple[int, int]], results: Any, count: int) -> list[Any]:
    """Each world's rank-0 value, once every process in `processes` (places[i]: its (world, rank))
    reported "ok"; RankFailed at the first failure seen (see the module docstring)."""
    values: list[Any] = [None] * count
    finished: set[tuple[int, int]] = set()
    beats: dict[tuple[int, int], float] = {}  # (world, rank) -> when its last heartbeat came
    while len(finished) < len(processes):
        for message in _drain(results, 0.1):
            if message[0] == "alive":
                beats[(message[1], message[2])] = time.monotonic()
            elif message[0] == "interrupted":
                raise KeyboardInterrupt
            elif message[0] == "error":
                raise _reported(message, processes, places, count)
            else:
                finished.add((message[1], message[2]))
                if message[2] == 0:
                    values[message[1]] = pickle.loads(message[3])
        # Judged with the queue drained: after this process was slow to read, the beats that waited
        # in the queue are the ranks' newest, not a sign they went silent.
        _check_beats(beats, finished, count)
        for process, (index, rank) in zip(processes, places, strict=True):
            if process.exitcode not in (None, 0) and (index, rank) not in finished:
                time.sleep(0.2)  # its own report may still be in the queue
                for late in _drain(results, 0.0):
                    if late[0] == "error":
                        raise _reported(late, processes, places, count)
                if process.exitcode < 0:
                    raise RankFailed(f"{where(index, rank, count)} was killed (signal {-process.exitcode})")
                raise RankFailed(
                    f"{where(index, rank, count)} exited with code {process.exitcode} before reporting"
                )
    return values


def _reported(message: tuple, processes: list, places: list[tuple[int, int]], count: int) -> RankFailed:
    """RankFailed for a rank's ("error", world, rank, line, traceback) message."""
    return killed_first(
        f"{where(message[1], message[2], count)} failed: {message[3]}", processes, places, count
    )


def _drain(results: Any, timeout_s: float) -> list[tuple]:
    """Every message queued now, waiting up to timeout_s for the first."""
    try:
        found = [results.get(timeout=timeout_s) if timeout_s > 0 else results.get_nowait()]
    except queue.Empty:
        return []
    with contextlib.suppress(queue.Empty):
        while True:
            found.append(results.get_nowait())
    return found


def _check_beats(beats: dict[tuple[int, int], float], finished: set[tuple[int, int]], count: int) -> None:
    """RankFailed for a rank that beat once, has not finished, and has been silent for LIVENESS_S."""
    now = time.monotonic()
    for (index, rank), last in beats.items():
        if (index, rank) not in finished and now - last > LIVENESS_S:
            raise RankFailed(
                f"{where(index, rank, count)} stopped answering (no heartbeat for {now - last:.0f} s: "
                "hung or stopped)"
            )


def stop(processes: list, grace_s: float = STOP_GRACE_S) -> None:
    """Terminate every process still running; kill those still running after grace_s; wait for all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
