"""Devices and dtypes by every name a caller may use: one set of rules for every face and pipeline.

"auto" resolves here (cuda when available; bfloat16 on a GPU, float32 on the CPU), and a device or
dtype that cannot be had is one line naming it, before any weight loads.
"""

from __future__ import annotations

from collections import deque
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


class StepFence:
    """How far the host runs ahead of the device in the denoise loop, counted in steps.

    After a step's work is queued, `queued()` waits until at most `ahead` steps are unfinished and
    returns how many steps finished since its last call (what progress may report now); `drain()` waits
    for the rest. ahead=0 waits for each step itself (progress shows each step as it ends). ahead=1
    keeps the next step queued while the host prepares the one after: the device does not idle between
    steps while the host runs the scheduler, the progress report and the next call's launches (a
    replayed CUDA graph step is short enough for that gap to show), and progress lags one step.
    Off CUDA every call has finished when it returns: each step is reported as it ends.
    """

    def __init__(self, device: str | torch.device, *, ahead: int = 1) -> None:
        if ahead not in (0, 1):
            raise ValidationError(f"steps ahead = {ahead!r}: allowed values are 0 and 1")
        self._device = torch.device(device)
        self._ahead = ahead if self._device.type == "cuda" else 0
        self._unfinished: deque[torch.cuda.Event] = deque()

    def queued(self) -> int:
        """One step's work is queued: wait as the fence allows; the number of steps finished meanwhile."""
        if self._ahead == 0:
            synchronize(self._device)
            return 1
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        self._unfinished.append(event)
        finished = 0
        while len(self._unfinished) > self._ahead:
            self._unfinished.popleft().synchronize()
            finished += 1
        return finished

    def drain(self) -> int:
        """Wait for every queued step; the number that finished."""
        finished = len(self._unfinished)
        if finished:
            self._unfinished[-1].synchronize()  # one stream: the last event's work is the last work
            self._unfinished.clear()
        return finished


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


__all__ = ("DTYPE_NAMES", "StepFence", "check_device", "check_dtype", "resolve_device", "resolve_dtype")
