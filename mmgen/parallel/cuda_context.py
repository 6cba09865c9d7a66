"""A GPU's primary CUDA context made through the driver API, before torch is imported.

A started rank (mmgen.parallel.standby) spends its first second or two importing torch, then makes its
GPU's CUDA context when its world's join sets its device (0.2-0.7 s measured on the lent hosts,
benchmarks/RESULTS.md 23), before the rendezvous and the NCCL communicator can begin. The context the
CUDA runtime (and so torch) uses is the device's *primary* context, which the driver API can make
too: `cuInit` then `cuDevicePrimaryCtxRetain`. Made in a thread from the process's start, beside the
imports (a ctypes call releases the GIL), it is there when torch sets the device, which then retains
the same context instead of creating one. It is retained for the process's life (the runtime holds it
as long anyway). Anything missing (no driver library, no such device, an error code) leaves it to
torch, as before: this only moves work earlier, never changes what is made.

Imports nothing heavy (ctypes, threading).
"""

from __future__ import annotations

import ctypes
import threading

CUDA_SUCCESS = 0


def retain_primary_context(ordinal: int, library: str = "libcuda.so.1") -> bool:
    """Make (or retain) the primary context of visible device `ordinal`; whether it is now made.

    False, with nothing raised, where the driver library cannot be loaded or a call fails."""
    try:
        cuda = ctypes.CDLL(library)
        device = ctypes.c_int()
        context = ctypes.c_void_p()
        return (
            cuda.cuInit(0) == CUDA_SUCCESS
            and cuda.cuDeviceGet(ctypes.byref(device), ordinal) == CUDA_SUCCESS
            and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == CUDA_SUCCESS
        )
    except (OSError, AttributeError):  # no such library, or one without the driver's functions
        return False


def start_primary_context(ordinal: int) -> threading.Thread:
    """retain_primary_context(ordinal) in a daemon thread, started now (see the module docstring)."""
    thread = threading.Thread(
        target=retain_primary_context, args=(ordinal,), name="mmgen-cuda-context", daemon=True
    )
    thread.start()
    return thread
