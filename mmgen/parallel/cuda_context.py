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

A rank of a world of several GPUs then has NCCL load its device code (its kernels) in the same thread:
the first communicator a process makes loads them (0.25-0.4 s of NCCL's 0.3-0.45 s init on an H200,
"kernels" in its NCCL_DEBUG=INFO init timings; benchmarks/RESULTS.md 26), and that is the world's join,
which the rank's load waits for. Made early through a one-rank communicator of the same libnccl.so.2
that torch links (loaded first by its path, torch's import then finds it loaded), they are there when
the world's communicator is made (its init then 0.03 s).

Imports nothing heavy (ctypes, threading, importlib.util).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading

from mmgen.parallel.process import nccl_defaults

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


def nccl_library(site: str | None = None) -> str | None:
    """The libnccl.so.2 torch's CUDA wheels link: pip's nvidia-nccl package in torch's site-packages
    (site: that folder; None: found without importing torch). None where there is none (a CPU build;
    a torch with NCCL inside its own libraries, which a second copy would not serve)."""
    if site is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.origin is None:
            return None
        site = os.path.dirname(os.path.dirname(spec.origin))
    path = os.path.join(site, "nvidia", "nccl", "lib", "libnccl.so.2")
    return path if os.path.exists(path) else None


def load_nccl_kernels(ordinal: int, library: str | None = None) -> bool:
    """NCCL's device code loaded in visible device `ordinal`'s primary context: a one-rank communicator
    made and destroyed through `library` (default: nccl_library()); whether it was. False, with nothing
    raised, where there is no such library or a call fails (torch's first communicator then loads them)."""
    library = library or nccl_library()
    if library is None:
        return False
    try:
        nccl = ctypes.CDLL(library)
        communicator = ctypes.c_void_p()
        devices = (ctypes.c_int * 1)(ordinal)
        if nccl.ncclCommInitAll(ctypes.byref(communicator), 1, devices) != 0:  # 0: ncclSuccess
            return False
        nccl.ncclCommDestroy(communicator)  # the kernels stay loaded in the context
        return True
    except (OSError, AttributeError):  # no such library, or one without NCCL's functions
        return False


def _early_device(ordinal: int, nccl: bool) -> None:
    if retain_primary_context(ordinal) and nccl:
        load_nccl_kernels(ordinal)


def start_primary_context(ordinal: int, nccl: bool = False) -> threading.Thread:
    """retain_primary_context(ordinal) in a daemon thread, started now, then (nccl: a rank of a world of
    several GPUs) load_nccl_kernels(ordinal) in it, under mmgen's NCCL settings (process.nccl_defaults,
    set here: NCCL reads them at its first call, that one). See the module docstring."""
    if nccl:
        nccl_defaults()
    thread = threading.Thread(
        target=_early_device, args=(ordinal, nccl), name="mmgen-cuda-context", daemon=True
    )
    thread.start()
    return thread
