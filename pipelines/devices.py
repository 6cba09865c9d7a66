"""Devices and dtypes by every name a caller may use: one set of rules for every face and pipeline.

"auto" resolves here (cuda when available; bfloat16 on a GPU, float32 on the CPU), and a device or
dtype that cannot be had is one line naming it, before any weight loads.
"""

from __future__ import annotations

from typing import Any

import torch

# The dtype rules live below pipelines (mmgen enhance checks dtypes too); re-exported here.
from mmgen.dtypes import DTYPE_NAMES, check_dtype
from mmgen.errors import ValidationError


def synchronize(device: str | torch.device) -> None:
    """Wait for the work queued on a CUDA device (a no-op elsewhere): progress and timings then show
    finished work, not queued launches."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; a CUDA device that is not there is an error."""
    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name.startswith("cuda") and not available:
        raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
    return name


def check_device(device: Any) -> str:
    """A device name or torch.device the weights can go to ('auto' resolves); a CUDA device that is
    not here, or a name torch does not know, is one line."""
    if not isinstance(device, (str, torch.device)):
        raise ValidationError(f"device {device!r}: expected a name such as cpu, cuda, cuda:1 or auto")
    name = str(device)
    if name == "auto":
        return resolve_device(name)
    try:
        parsed = torch.device(name)
    except RuntimeError:
        raise ValidationError(f"device {name!r}: not a device; expected cpu, cuda, cuda:N or auto") from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
        if parsed.index is not None and parsed.index >= count:
            raise ValidationError(f"device {name!r}: this machine shows {count} CUDA device(s)")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """'auto' -> 'bfloat16' on a GPU, 'float32' on the CPU; fp32/bf16/fp16 -> torch's names; others pass."""
    if name == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return DTYPE_NAMES.get(name, name)  # fp16 -> float16: one name per dtype in plans and A/B checks


__all__ = ("DTYPE_NAMES", "check_device", "check_dtype", "resolve_device", "resolve_dtype")
