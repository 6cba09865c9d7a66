"""The LoRAs a pipeline has on its experts now: switched per request, reused while unchanged."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from mmgen.errors import ValidationError
from mmgen.lora.apply import AppliedLoRAs, apply_loras, resolve_experts
from mmgen.lora.readers import LoRAFile, read_lora_file
from mmgen.lora.report import LoRAReport
from mmgen.lora.request import LoRARequest, check_mode


class LoRASlot:
    """Holds one AppliedLoRAs (or none) for a set of experts.

    `use(...)` makes the experts carry exactly the requested LoRAs: the same request as last time
    (same files by path, size and mtime; same strengths, experts, mode) keeps what is applied;
    anything else restores the base weights first, then reads, checks and applies the new set. A
    failure leaves the experts at their base weights. No base-model reload is ever needed.
    """

    def __init__(self, reader: Callable[[Path], LoRAFile] | None = None) -> None:
        # reader(path) -> LoRAFile: read_lora_file (Wan's layouts) unless a model family brings its own.
        self._reader = read_lora_file if reader is None else reader
        self._applied: AppliedLoRAs | None = None
        self._key: tuple | None = None
        self.loads = 0  # LoRA sets read and applied so far (a kept set is not counted)

    @property
    def applied(self) -> tuple | None:
        """What is applied now (the requests with their files' stats, the mode, the experts), None
        with no LoRAs: equal values, equal weights and modules (a kept CUDA graph's signature)."""
        return self._key

    @property
    def report(self) -> LoRAReport | None:
        return None if self._applied is None else self._applied.report

    def use(
        self,
        experts: Sequence[nn.Module],
        requests: Sequence[LoRARequest],
        *,
        mode: str = "fused",
        allow_unmatched: bool = False,
    ) -> LoRAReport | None:
        """Apply `requests` (replacing whatever is on); returns the report, or None with no LoRAs."""
        check_mode(mode)
        for request in requests:
            resolve_experts(request, len(experts))  # cheap checks before any file is read
        key = (tuple((r, _stat(r)) for r in requests), mode, allow_unmatched, tuple(id(e) for e in experts))
        if key == self._key:
            return self.report
        self.clear()
        if not requests:
            return None
        files = [self._reader(r.path) for r in requests]
        for request, lora in zip(requests, files, strict=True):
            if request.sha256 is not None and lora.sha256 != request.sha256:
                raise ValidationError(
                    f"LoRA file {str(request.path)!r} changed: its sha256 is {lora.sha256[:16]}..., "
                    f"expected {request.sha256[:16]}... (recorded when the request was made)"
                )
        self._applied = apply_loras(
            experts, list(zip(requests, files, strict=True)), mode=mode, allow_unmatched=allow_unmatched
        )
        self._key = key
        self.loads += 1
        return self._applied.report

    def clear(self) -> None:
        """Restore the base weights (bitwise) and forget the applied set."""
        if self._applied is not None:
            self._applied.remove()
        self._applied, self._key = None, None


def _stat(request: LoRARequest) -> tuple[int, int] | None:
    try:
        stat = request.path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns
