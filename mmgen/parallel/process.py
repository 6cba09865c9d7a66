"""What a launcher and its rank processes both need before torch is imported (no heavy import here):
whether torchrun started this process, the rank's die-with-parent signal, a free loopback port, the
collectives' timeout."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

DEFAULT_TIMEOUT_S = 300.0  # a collective waits at most this long (model loads on other ranks included)


def torchrun_environment() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the launcher dies (a killed run leaves no orphans)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port() -> int:
    """A loopback TCP port free now (a world's rendezvous address)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
