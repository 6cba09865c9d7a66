"""Devices and dtypes by every name a caller may use: one set of rules for every face and pipeline.

"auto" resolves here (cuda when available; bfloat16 on a GPU, float32 on the CPU), and a device or
dtype that cannot be had is one line naming it, before any weight loads.
"""

from __future__ import annotations

from typing import Any

from mmgen.errors import ValidationError

# The dtypes weights load in, by every name a caller may use: torch's, and the CLI's short ones.
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when available, else 'cpu'; a CUDA device that is not there is an error."""
    import torch

    available = torch.cuda.is_available()
    if name == "auto":
        return "cuda" if available else "cpu"
    if name.startswith("cuda") and not available:
        raise ValidationError(f"device {name!r}: CUDA is not available here; use cpu")
    return name


def check_dtype(dtype: Any = None, *, torch_dtype: Any = None) -> Any:
    """The torch dtype of `dtype` (diffusers' keyword `torch_dtype` is the same thing): torch.float32 /
    bfloat16 / float16 or a name float32|bfloat16|float16|fp32|bf16|fp16; None = float32."""
    import torch

    if torch_dtype is not None:
        if dtype is not None and check_dtype(dtype) != check_dtype(torch_dtype):
            raise ValidationError(f"dtype {dtype!r} and torch_dtype {torch_dtype!r} disagree: give one")
        dtype = torch_dtype
    if dtype is None:
        return torch.float32
    name = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValidationError(
            f"dtype {dtype!r}: allowed torch.float32, torch.bfloat16, torch.float16 or the names "
            f"{'|'.join(DTYPE_NAMES)}"
        )
    return getattr(torch, DTYPE_NAMES[name])


def check_device(device: Any) -> str:
    """A device name or torch.device the weights can go to ('auto' resolves); a CUDA device that is
    not here, or a name torch does not know, is one line."""
    import torch

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
