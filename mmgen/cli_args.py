"""Helpers every `mmgen` subcommand shares (generate in mmgen/cli.py, render/ab in mmgen/render/cli.py).

Kept in their own module so the top-level CLI and the render CLI both import down, never each other.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

EXIT_ERROR = 2  # any MmgenError: invalid input, a refused A/B
EXIT_INTERRUPTED = 130  # SIGINT
EXIT_TERMINATED = 143  # SIGTERM (128 + 15), what `timeout` and schedulers send


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like SIGINT's KeyboardInterrupt so the same cleanup runs (temp files, ffmpeg)."""


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside, SIGTERM raises Terminated in the main thread; the previous handler comes back after.

    Python's default for SIGTERM is to die at once, skipping every `finally`: a killed encode would
    leave its temp file behind. Outside the main thread (signals cannot be set there) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def one_line(err: BaseException) -> str:
    """An error message collapsed onto one line."""
    return " ".join(str(err).split()) or type(err).__name__


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


def run_command(args: argparse.Namespace) -> int:
    """Run a parsed subcommand's `func(args)`: every MmgenError or OSError is one line
    "mmgen: error: ..." and exit 2; SIGINT / SIGTERM one line and exit 130 / 143; never a traceback."""
    from mmgen.errors import MmgenError

    try:
        with sigterm_as_interrupt():
            return int(args.func(args))
    except (MmgenError, OSError) as err:
        print(f"mmgen: error: {one_line(err)}", file=sys.stderr)
        return EXIT_ERROR
    except Terminated:
        print("mmgen: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("mmgen: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
