"""A GPU process's one-time kernel set-up, begun beside its pipeline's load instead of inside its first step.

A process's first denoise step pays, before its kernels run, for set-up nothing before it needed:
- Triton's: the import of the kernels' modules (mmgen.layers.fused_norms and fused_activations run
  through them) with Triton's compiler and backends, and Triton's cache key, a sha256 of its own
  compiler sources and native library (`triton_key`, cached for the process);
- the libraries': cuBLAS / cuBLASLt's and cuDNN's first calls on the device (their handles, their
  first kernels loaded: CUDA loads a kernel at its first launch), the first layer norm's, and the
  first launches of the step's elementwise kernels (its RoPE tables, rotary and modulation).
Profiled on an H200 (benchmarks/RESULTS.md 26, 27), a Wan2.1-1.3B forward's first call at 480x832x21
was 0.83 s over its second with neither done; 0.45 s with Triton's; 0.29 s with both. In `generate
--gpus N` the difference is larger on the ranks other than 0: rank 0's text encoder had called cuBLAS
before its first step, the others had not, and rank 0 waits for them at the step's first exchange.

A model family may add its own first launches (mmgen.families.Family.first_kernels: Wan's text encoder's,
on a one-layer encoder, which halved the first prompt's encode: RESULTS.md 31), run after the libraries'.

`start_kernel_set_up(device, dtype, first_kernels)` does all this in daemon threads from the load's
start: the hashing and the file reads release the GIL, so do torch's ops, so it runs beside the weights'
reads; the first step then finds the key cached and the libraries set up. Its kernels are a few small
ones of its own (nothing of the model's is touched; their results are dropped), on `device` (the
thread's own current device is set to it: a new thread's would be GPU 0). Anything missing (no Triton,
a Triton without the key where it is looked for, a failing call) leaves the first step to do it, as
before.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable

import torch

from mmgen.layers.modulation import gated_residual, modulate_as
from mmgen.layers.rotary import apply_rope, rope_3d_tables

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


def library_set_up(device: torch.device, dtype: torch.dtype) -> None:
    """cuBLAS / cuBLASLt's and cuDNN's first calls on CUDA `device` in dtype: matmuls with and without a
    bias, one with the bias and GELU in the epilogue (as mmgen.layers.low_rank.gelu_tanh_epilogue), a
    strided conv3d (a patch embedding's), a float32 layer norm, and the step's own rotary and modulation
    helpers on tiny inputs. Rows enough for the large tiles a step's matmuls use; its tensors (a few MB)
    are freed when it returns, the libraries' handles (and cuBLAS's workspace) stay with torch, as after
    any thread's first call."""
    with torch.cuda.device(device), torch.no_grad():
        rows = torch.ones(2048, 512, device=device, dtype=dtype)
        weight, bias = rows[:512], rows[0]
        torch.nn.functional.linear(rows, weight, bias)
        torch.nn.functional.linear(rows, weight)
        torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
        video = torch.ones(1, 16, 2, 32, 32, device=device, dtype=dtype)
        kernel = torch.ones(64, 16, 1, 2, 2, device=device, dtype=dtype)
        torch.nn.functional.conv3d(video, kernel, stride=(1, 2, 2))
        torch.nn.functional.layer_norm(rows.float(), (512,))
        # The step's elementwise helpers on tiny inputs, broadcast as the step's are: a kernel loads at its
        # first launch (RESULTS.md 27's profile of a first step: one addcmul 0.075 s, the RoPE tables'
        # float64 pow and cos / sin 0.05 s)
        tokens = torch.ones(2, 4, 2, 12, device=device, dtype=dtype)  # [B, S, heads, head_dim]
        apply_rope(tokens, *rope_3d_tables((1, 2, 2), 12, device=device))
        normed, vector = torch.ones(2, 4, 8, device=device), torch.ones(2, 1, 8, device=device)
        gated_residual(modulate_as(normed, vector, vector, dtype), normed.to(dtype), vector)
        torch.cuda.current_stream(device).synchronize()


def start_kernel_set_up(
    device: torch.device,
    dtype: torch.dtype,
    first_kernels: Callable[[torch.device, torch.dtype], None] | None = None,
) -> threading.Thread:
    """triton_set_up() and, for a CUDA device with an index, library_set_up(device, dtype) then
    first_kernels(device, dtype) (a model family's own first launches, e.g. its text encoder's) beside
    it in daemon threads, started now; the thread returned ends when both have (join it to wait for
    both). Their errors are the first request's to raise.

    Two threads, not one after the other: with the weights read in ~1 s (an H200, Wan2.1-1.3B + UMT5-XXL),
    Triton's ~0.6 s then the libraries' ~0.5 s outlasted the load and ran into the text encoder's first
    call, which needs the libraries (cuBLAS) first. Triton's import holds the GIL, the libraries' set-up
    mostly waits on the driver without it."""

    def run() -> None:
        libraries = None
        if device.type == "cuda" and device.index is not None:
            libraries = threading.Thread(
                target=_libraries_then_family,
                args=(device, dtype, first_kernels),
                name="mmgen-library-set-up",
                daemon=True,
            )
            libraries.start()
        _quietly(triton_set_up)
        if libraries is not None:
            libraries.join()

    thread = threading.Thread(target=run, name="mmgen-kernel-set-up", daemon=True)
    thread.start()
    return thread


def _libraries_then_family(
    device: torch.device,
    dtype: torch.dtype,
    first_kernels: Callable[[torch.device, torch.dtype], None] | None,
) -> None:
    _quietly(library_set_up, device, dtype)
    if first_kernels is not None:
        with torch.cuda.device(device):
            _quietly(first_kernels, device, dtype)


def _quietly(set_up: Callable[..., object], *args: object) -> None:
    try:
        set_up(*args)
    except Exception:  # noqa: BLE001 - only moves work earlier: the first step meets any error itself
        pass
