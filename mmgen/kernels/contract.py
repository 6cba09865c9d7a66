"""What every kernel reference and provider shares: the two errors, argument checks, the window convention,
the dtypes the real kernels take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmgen.errors import MmgenError

KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # what the real attention kernels take


class KernelContractError(MmgenError, ValueError):
    """A kernel call breaks the kernel's contract (shapes, dtypes, stale metadata, unsupported argument)."""


class KernelUnavailableError(MmgenError):
    """The requested kernel library is not installed or cannot run on this machine."""


def window_bounds(window_size: Sequence[int | None] | None) -> tuple[int | None, int | None]:
    """(left, right) with None for unbounded; -1 and None both mean unbounded."""
    if window_size is None:
        return None, None
    left, right = window_size
    return (None if left is None or left < 0 else left), (None if right is None or right < 0 else right)


def require_int32(name: str, t: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> None:
    """Raise unless t (when given) is int32 of `shape`: the kernels read index tensors as int32."""
    if t is None:
        return
    if t.dtype != torch.int32:
        raise KernelContractError(f"{name} must be int32 (the kernels read it as int32), got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelContractError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def reject_unsupported(**unsupported: Any) -> None:
    """Raise for any argument set to something other than its 'off' value (None, False, 0)."""
    for name, value in unsupported.items():
        is_off = value is None or (isinstance(value, (bool, int, float)) and not value)
        if not is_off:
            shown = f"a tensor {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise KernelContractError(f"the mmgen kernel adapters do not implement {name} (got {shown})")


def cu_bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each sequence of a cu_seqlens int32 [B + 1] tensor, as host ints."""
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1)]


def gpu_kernels_apply(device: torch.device | str | None, dtype: torch.dtype | None) -> bool:
    """Whether data of this device/dtype can run through real GPU attention kernels (None = unknown: yes)."""
    on_cuda = device is None or torch.device(device).type == "cuda"
    return on_cuda and (dtype is None or dtype in KERNEL_DTYPES)
