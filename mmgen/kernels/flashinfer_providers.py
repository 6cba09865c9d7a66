"""FlashInfer's merge_state (pure-torch reference) and the provider objects the flashinfer backend calls.

`ReferenceFlashInfer` serves the references of `mmgen.kernels.flashinfer` under FlashInfer's names,
`FlashInferLibrary` the installed flashinfer package; `load_flashinfer_provider` picks one. merge_state
follows flashinfer-python 0.7.2.post1 (cascade.py): LSEs are base 2.
"""

from __future__ import annotations

import collections
import importlib
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.kernels.contract import KernelUnavailableError, gpu_kernels_apply
from mmgen.kernels.flashinfer import (
    FLASHINFER_VERSION,
    BatchDecodeWithPagedKVCacheWrapper,
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
)
from mmgen.kernels.flashinfer_wrapper import LOG2E

__all__ = [
    "FlashInferLibrary",
    "ReferenceFlashInfer",
    "load_flashinfer_provider",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
]


# merge_state (cascade.py), base-2 LSE


def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states: v [N, H, D] (v_a's dtype out), s float32 [N, H] base-2 LSE -> (v, s).

    Equals attention over the union of both key sets. An empty side (s = -inf) contributes nothing;
    two empty sides give v 0 and s -inf, as the FlashInfer kernel guards.
    """
    s_a, s_b = s_a.float(), s_b.float()
    s_max = torch.maximum(s_a, s_b)
    finite_max = torch.where(torch.isfinite(s_max), s_max, torch.zeros_like(s_max))
    w_a = torch.exp2(s_a - finite_max)
    w_b = torch.exp2(s_b - finite_max)
    total = w_a + w_b
    safe = torch.where(total > 0, total, torch.ones_like(total))
    v = (v_a.float() * (w_a / safe)[..., None] + v_b.float() * (w_b / safe)[..., None]).to(v_a.dtype)
    s = torch.where(total > 0, torch.log2(safe) + finite_max, torch.full_like(s_max, float("-inf")))
    return v, s


def merge_state_in_place(
    v: torch.Tensor,
    s: torch.Tensor,
    v_other: torch.Tensor,
    s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge (v_other, s_other) into (v [N, H, D], s [N, H]) in place; mask bool [N] picks the rows to merge."""
    merged_v, merged_s = merge_state(v, s, v_other, s_other)
    if mask is not None:
        merged_v = torch.where(mask[:, None, None], merged_v, v)
        merged_s = torch.where(mask[:, None], merged_s, s)
    v.copy_(merged_v)
    s.copy_(merged_s)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge several states: v [N, S, H, D], s [N, S, H] base 2 -> (v [N, H, D], s [N, H])."""
    s = s.float()
    total = torch.logsumexp(s / LOG2E, dim=1)  # natural
    weights = torch.exp(s / LOG2E - total[:, None].clamp_min(torch.finfo(torch.float32).min))
    weights = torch.nan_to_num(weights, nan=0.0)
    merged = (v.float() * weights[..., None]).sum(dim=1).to(v.dtype)
    return merged, total * LOG2E


# Providers


class ReferenceFlashInfer:
    """The references behind FlashInfer's names. `calls` counts wrapper plan/run calls
    ("BatchDecodeWithPagedKVCacheWrapper.plan", ...) and merge_state calls."""

    name = "reference"
    version = f"mmgen reference of {FLASHINFER_VERSION}"

    def __init__(self) -> None:
        self.calls: collections.Counter = collections.Counter()

    def BatchPrefillWithRaggedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchPrefillWithRaggedKVCacheWrapper:
        """A reference ragged prefill wrapper (same constructor arguments as FlashInfer's)."""
        return BatchPrefillWithRaggedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def BatchPrefillWithPagedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchPrefillWithPagedKVCacheWrapper:
        """A reference paged prefill wrapper (same constructor arguments as FlashInfer's)."""
        return BatchPrefillWithPagedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def BatchDecodeWithPagedKVCacheWrapper(
        self, *args: Any, **kwargs: Any
    ) -> BatchDecodeWithPagedKVCacheWrapper:
        """A reference paged decode wrapper (same constructor arguments as FlashInfer's)."""
        return BatchDecodeWithPagedKVCacheWrapper(*args, call_counter=self.calls, **kwargs)

    def merge_state(
        self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """See the module function `merge_state`."""
        self.calls["merge_state"] += 1
        return merge_state(v_a, s_a, v_b, s_b)


class FlashInferLibrary:
    """The installed flashinfer package behind the same names. `calls` counts wrapper constructions
    and merge_state calls (the library's own wrappers do not count plan/run)."""

    name = "flashinfer"

    def __init__(self, module: Any) -> None:
        self.module = module
        self.version = f"flashinfer {getattr(module, '__version__', 'unknown')}"
        self.calls: collections.Counter = collections.Counter()

    def BatchPrefillWithRaggedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchPrefillWithRaggedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchPrefillWithRaggedKVCacheWrapper"] += 1
        return self.module.BatchPrefillWithRaggedKVCacheWrapper(*args, **kwargs)

    def BatchPrefillWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchPrefillWithPagedKVCacheWrapper"] += 1
        return self.module.BatchPrefillWithPagedKVCacheWrapper(*args, **kwargs)

    def BatchDecodeWithPagedKVCacheWrapper(self, *args: Any, **kwargs: Any) -> Any:
        """flashinfer.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)."""
        self.calls["BatchDecodeWithPagedKVCacheWrapper"] += 1
        return self.module.BatchDecodeWithPagedKVCacheWrapper(*args, **kwargs)

    def merge_state(
        self, v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """flashinfer.merge_state (base-2 LSE)."""
        self.calls["merge_state"] += 1
        return self.module.merge_state(v_a, s_a, v_b, s_b)


_PROVIDER_NAMES = ("auto", "flashinfer", "reference")


def load_flashinfer_provider(
    name: str = "auto", *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> ReferenceFlashInfer | FlashInferLibrary:
    """The FlashInfer provider called `name` ("auto" | "flashinfer" | "reference").

    "auto" is flashinfer when it imports, a CUDA device exists and the data (device/dtype, None =
    unknown) is CUDA bf16/fp16, else the reference; "flashinfer" raises KernelUnavailableError when
    the library or the device is missing.
    """
    if name not in _PROVIDER_NAMES:
        raise ValidationError(
            f"unknown FlashInfer provider {name!r}: expected one of {', '.join(_PROVIDER_NAMES)}"
        )
    if name == "reference":
        return ReferenceFlashInfer()
    if name == "auto" and not gpu_kernels_apply(device, dtype):
        return ReferenceFlashInfer()
    if not torch.cuda.is_available():
        if name == "auto":
            return ReferenceFlashInfer()
        raise KernelUnavailableError(
            "FlashInfer provider 'flashinfer' needs a CUDA device; none is available"
        )
    try:
        module = importlib.import_module("flashinfer")
    except (ImportError, OSError, RuntimeError) as err:
        if name == "auto":
            return ReferenceFlashInfer()
        raise KernelUnavailableError(
            f"FlashInfer provider 'flashinfer' is not installed (pip install flashinfer-python): {err}"
        ) from err
    return FlashInferLibrary(module)
