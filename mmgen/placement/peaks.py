"""Peak GPU memory per pipeline stage, measured with the CUDA caching allocator's counters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from mmgen.placement.policy import GIB


class StagePeaks:
    """Measures each stage's peak allocated memory (GiB) on `device`; records nothing off CUDA.

    One instance per request (nothing carries between requests). `gib` maps stage -> peak.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.gib: dict[str, float] = {}

    @property
    def active(self) -> bool:
        return self.device.type == "cuda"

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.active:
            yield
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            self.gib[name] = round(torch.cuda.max_memory_allocated(self.device) / GIB, 3)
