"""Triton's one-time set-up of a process, begun beside a GPU pipeline's load instead of inside its first step.

A process's first Triton kernel call (the DiT's fused norms and activations, mmgen.layers.fused_norms
and fused_activations) pays, before any kernel runs: the import of the kernels' modules (and Triton's
compiler and backends), and Triton's cache key, a sha256 of its own compiler sources and native library
(`triton_key`, cached for the process). Profiled on an H200 (benchmarks/RESULTS.md 26) that was
0.4-0.45 s of the first denoise step of a Wan2.1-1.3B `generate` (0.30 s of it hashing) on every rank.
`start_triton_set_up()` does both in a daemon thread from the load's start: the hashing and the file
reads release the GIL, so it runs beside the weights' reads; the first step then finds the key cached.
Nothing is compiled or launched here, and anything missing (no Triton, a Triton without the key where
it is looked for) leaves the first call to do it, as before.
"""

from __future__ import annotations

import importlib
import threading

# the modules whose kernels a DiT step calls first (each imports triton)
KERNEL_MODULES = ("mmgen.layers.triton_norms", "mmgen.layers.triton_activations")


def triton_set_up() -> bool:
    """Import KERNEL_MODULES and compute Triton's cache key; whether both were done (False: no Triton,
    or no key function where Triton 3.x keeps it)."""
    try:
        for name in KERNEL_MODULES:
            importlib.import_module(name)
        from triton.runtime.cache import triton_key
    except ImportError:
        return False
    triton_key()  # functools.lru_cache: the JIT's own first call then returns it
    return True


def start_triton_set_up() -> threading.Thread:
    """triton_set_up() in a daemon thread, started now; its errors are the first kernel call's to raise."""

    def run() -> None:
        try:
            triton_set_up()
        except Exception:  # noqa: BLE001 - only moves work earlier: the first call meets any error itself
            pass

    thread = threading.Thread(target=run, name="mmgen-triton-set-up", daemon=True)
    thread.start()
    return thread
