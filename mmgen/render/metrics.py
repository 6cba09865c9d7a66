"""Differences between two uint8 frame stacks: max/mean absolute difference and PSNR."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mmgen.errors import ValidationError


@dataclass(frozen=True)
class FrameDiff:
    """max_abs and mean_abs in uint8 levels (0-255); psnr in dB, inf when the frames are identical."""

    max_abs: int
    mean_abs: float
    psnr: float

    @property
    def identical(self) -> bool:
        return self.max_abs == 0


def psnr_uint8(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 arrays of one shape (peak 255, MSE over every value); inf if equal."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0**2 / mse)


def frame_diff(a: np.ndarray, b: np.ndarray) -> FrameDiff:
    """Compare uint8 frames [T, H, W, 3] (or any equal shapes) exactly."""
    if a.shape != b.shape:
        raise ValidationError(f"cannot compare frames of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise ValidationError(f"frames must be uint8, got {a.dtype} and {b.dtype}")
    delta = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return FrameDiff(max_abs=int(delta.max()), mean_abs=float(delta.mean()), psnr=psnr_uint8(a, b))
