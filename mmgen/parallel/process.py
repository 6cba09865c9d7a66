"""What a launcher and its rank processes both need before torch is imported (no heavy import here):
whether torchrun started this process, the rank's die-with-parent signal, a free loopback port, the
collectives' timeout, NCCL's settings."""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import sys

DEFAULT_TIMEOUT_S = 300.0  # a collective waits at most this long (model loads on other ranks included)

# NCCL's settings in mmgen's ranks where the environment sets none (a value the user sets wins).
# NCCL_CUMEM_ENABLE=0: the peers' buffers are shared through CUDA IPC handles, not cuMem's. With cuMem each
# connection's first use (a collective's first algorithm and protocol) took 0.15-0.2 s on 2x H200, the
# world's warm-up 0.35-0.4 s; without it 0.03-0.04 s (benchmarks/RESULTS.md 26). vLLM and SGLang turn it
# off as well. NVLink SHARP (NVLS) needs cuMem, so it is off too (the lent hosts run without it).
NCCL_DEFAULTS = {"NCCL_CUMEM_ENABLE": "0"}


def torchrun_environment() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def nccl_defaults() -> None:
    """NCCL_DEFAULTS in this process's environment where unset. Before the process's first NCCL call:
    NCCL reads its settings once."""
    for name, value in NCCL_DEFAULTS.items():
        os.environ.setdefault(name, value)


def die_with_parent() -> None:
    """Linux: have the kernel kill this worker when the launcher dies (a killed run leaves no orphans)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
# below the kernel's ephemeral ports: the rendezvous ports free_port draws from
RENDEZVOUS_PORTS = 16384


def free_port(ephemeral_range: str = EPHEMERAL_RANGE) -> int:
    """A loopback TCP port free now (a world's rendezvous address), drawn at random below the kernel's
    ephemeral range where it is known (Linux), else any free one.

    Why not the kernel's own pick (bind to port 0): that is an ephemeral port, which any outgoing
    connection may take as its source port between this check and the rendezvous store's listen, seconds
    later (seen on a 2x H200 host: EADDRINUSE when one `mmgen generate --gpus 2` ran right after another,
    whose ranks were still closing their connections)."""
    try:
        with open(ephemeral_range) as ranges:
            first = int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        first = 0
    low = max(1024, first - RENDEZVOUS_PORTS)
    draw = random.Random(os.urandom(8))  # its own generator: no shared state, never the same sequence
    for port in (draw.randrange(low, first) for _ in range(64)) if first > low else ():
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # taken: another
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
