"""The environment fingerprint every result carries: what could change the output bits.

Two runs whose fingerprints differ only in a declared variable (say `attention_providers`) form a
fair A/B pair; a difference anywhere else (torch version, TF32, GPU) makes a SHA comparison moot.
Kernel libraries are found by their installed distribution metadata, never imported: importing
flash-attn or flashinfer costs seconds and may initialize CUDA.
"""

from __future__ import annotations

import importlib.metadata
import platform

import torch

import mmgen

# Attention kernel libraries, by distribution name: flash-attn (FA2), flash-attn-4 (FA4, module
# flash_attn.cute), flash-attn-3 (FA3 built from source, module flash_attn_interface), fa3-fwd
# (prebuilt FA3 forward, module fa3_fwd_interface), flashinfer-python (module flashinfer).
KERNEL_DISTRIBUTIONS = ("flash-attn", "flash-attn-4", "flash-attn-3", "fa3-fwd", "flashinfer-python")


def environment_fingerprint(
    *, device: str | torch.device, dtype: torch.dtype, attention_providers: dict[str, str]
) -> dict:
    """A JSON-ready dict of versions, device, numerics flags and the attention provider per site."""
    device = torch.device(device)
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    return {
        "mmgen": mmgen.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": _distribution_version(("diffusers",)),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "kernels": kernel_library_versions(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
        "dtype": str(dtype).removeprefix("torch."),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "deterministic": bool(torch.are_deterministic_algorithms_enabled()),
        "cpu_threads": torch.get_num_threads(),
        "attention_providers": dict(sorted(attention_providers.items())),
    }


def kernel_library_versions() -> dict[str, str | None]:
    """{distribution: installed version or None} for each attention kernel library, without importing it."""
    return {name: _distribution_version((name,)) for name in KERNEL_DISTRIBUTIONS}


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
