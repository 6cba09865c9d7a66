"""Helpers every `mmgen` subcommand shares (generate in mmgen/cli.py, render/ab in mmgen/render/cli.py).

Kept in their own module so the top-level CLI and the render CLI both import down, never each other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from mmgen.errors import MmgenError, Terminated, one_line

EXIT_ERROR = 2  # any MmgenError: invalid input, a refused A/B
EXIT_INTERRUPTED = 130  # SIGINT
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), what `timeout` and schedulers send


class SigtermHandling:
    """What SIGTERM does in one command: raise Terminated while it works; once the work is done
    (`work_done`), one line on stderr and then the handler that was there before, until the process
    exits (python's default: the process ends with status 143)."""

    def __init__(self) -> None:
        self.previous: Any = None  # the handler before; None outside the main thread (nothing set)
        self.done = False

    def raise_terminated(self, signum: int, frame: object) -> None:
        raise Terminated()

    def work_done(self, status: int) -> None:
        """The command returned `status`: its outputs are written and reported."""
        if self.previous is not None:
            signal.signal(signal.SIGTERM, lambda signum, frame: self.after_work(status))
            self.done = True  # after the swap: a SIGTERM before it raised Terminated, still in time

    def after_work(self, status: int) -> None:
        # Interrupting now would undo nothing: say so (the result lines on stdout first), then let
        # the signal end the process as it would have (or reach the embedding program's handler).
        signal.signal(signal.SIGTERM, self.previous)
        sys.stdout.flush()
        print(
            f"mmgen: terminated after the command finished (status {status}); its outputs are published",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[SigtermHandling]:
    """While inside, SIGTERM raises Terminated in the main thread; the previous handler comes back after,
    unless the yielded SigtermHandling was told the work is done: it then stays until a SIGTERM comes
    or the process exits, so a SIGTERM in the last moments is never a silent exit 143.

    Python's default for SIGTERM is to die at once, skipping every `finally`: a killed encode would
    leave its temp file behind. Outside the main thread (signals cannot be set there) this does nothing.
    """
    handling = SigtermHandling()
    if threading.current_thread() is not threading.main_thread():
        yield handling
        return
    previous = signal.signal(signal.SIGTERM, handling.raise_terminated)
    handling.previous = signal.SIG_DFL if previous is None else previous
    try:
        yield handling
    finally:
        if not handling.done:
            signal.signal(signal.SIGTERM, previous)


def add_progress_flags(parser: argparse.ArgumentParser) -> None:
    """--progress / --no-progress setting args.progress to True / False (None: bars only on a terminal)."""
    bars = parser.add_mutually_exclusive_group()
    bars.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show bars"
    )
    bars.add_argument("--no-progress", dest="progress", action="store_false", help="never show bars")


def add_parallel_flags(parser: argparse.ArgumentParser, *, sp_default: str) -> None:
    """--gpus / --sp / --ring / --cfg-parallel (mmgen.parallel; on the CPU, --gpus N = N gloo processes)."""
    group = parser.add_argument_group("several GPUs (sequence and CFG parallel)")
    group.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="worker processes, one per GPU (CPU: gloo processes); default 1, under torchrun its world size",
    )
    group.add_argument(
        "--sp", type=int, default=None, help=f"ranks sharing one sample's tokens (default: {sp_default})"
    )
    group.add_argument(
        "--ring", type=int, default=1, help="of the --sp ranks, how many pass KV blocks in a ring"
    )
    group.add_argument(
        "--cfg-parallel",
        action="store_true",
        help="conditional and unconditional branches on different ranks",
    )


def run_command(args: argparse.Namespace, func: Callable[[argparse.Namespace], int] | None = None) -> int:
    """Run a parsed subcommand's `func(args)` (args.func unless given): every MmgenError or OSError is
    one line "mmgen: error: ..." and exit 2; SIGINT / SIGTERM one line and exit 130 / 143; never a
    traceback.

    A SIGTERM after func returned (its outputs published, its result lines printed) still ends the
    process with 143, as a scheduler expects of SIGTERM, after one line saying the work was done."""
    try:
        with sigterm_as_interrupt() as sigterm:
            status = int((func or args.func)(args))
            sigterm.work_done(status)
            return status
    except (MmgenError, OSError, KeyboardInterrupt) as err:  # KeyboardInterrupt: SIGINT, SIGTERM
        line, status = ending(err)
        print(line, file=sys.stderr)
        return status


def ending(error: BaseException) -> tuple[str, int]:
    """The line and exit status a command ends with for `error`: SIGTERM (Terminated) "mmgen: terminated"
    143, SIGINT "mmgen: interrupted" 130, any other "mmgen: error: ..." 2."""
    if isinstance(error, Terminated):
        return "mmgen: terminated", EXIT_TERMINATED
    if isinstance(error, KeyboardInterrupt):
        return "mmgen: interrupted", EXIT_INTERRUPTED
    return f"mmgen: error: {one_line(error)}", EXIT_ERROR
