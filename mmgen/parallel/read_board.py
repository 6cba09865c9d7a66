"""ReadBoard: the pieces of a load the processes of one world take from one another, as each is free.

A world's ranks split their reads of the weights (mmgen.parallel.share.SplitReads) so that the host's
bytes are read once and cross between the GPUs. A fixed split ends when its slowest rank ends, and the
ranks do not start alike: `mmgen generate --gpus N`'s rank 0 is the command's own process, the others
started beside it, whose imports end later and whose reads run beside each other's. With a board every
rank takes the next piece of each part as one of its reading threads is free, so they end together.
The counters live in shared memory made before the ranks are spawned (standby.StartedRanks), one per
part. Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any


class ReadBoard:
    """One counter per part (SLOTS at most): the index of the next piece nobody has taken."""

    SLOTS = 8

    def __init__(self, context: Any) -> None:
        """context: the multiprocessing context the world's processes are spawned with (the board goes
        to them with their arguments)."""
        self._next: Any = context.Array("q", self.SLOTS)  # zeroed, with its lock

    def take(self, slot: int, count: int) -> int | None:
        """The next piece of part `slot`'s `count`, now this process's; None when all are taken."""
        if self._next is None:
            raise ValueError("this read board is closed")
        if not 0 <= slot < self.SLOTS:
            raise ValueError(f"a read board has {self.SLOTS} parts; part {slot} asked")
        with self._next.get_lock():
            index = self._next[slot]
            if index >= count:
                return None
            self._next[slot] = index + 1
            return index

    def close(self) -> None:
        """Let go of the shared memory and its lock here (the process that made it: its semaphore is
        unlinked now, not reported as leaked by multiprocessing's resource tracker after an os._exit)."""
        self._next = None
