"""Differences between two uint8 frame stacks: max/mean absolute difference, PSNR and SSIM."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from skimage.metrics import structural_similarity

from mmgen.errors import ValidationError

# SSIM's window (Wang et al. 2004: an 11x11 Gaussian, sigma 1.5) needs frames at least this large;
# smaller frames (the embedded model's tiny tests) use the largest odd window that fits, down to 3.
SSIM_MIN_SIDE = 3


@dataclass(frozen=True)
class FrameDiff:
    """max_abs and mean_abs in uint8 levels (0-255); psnr in dB, inf when the frames are identical;
    ssim the mean over frames of the per-frame SSIM (1.0 when identical; None when frames are too
    small for any window)."""

    max_abs: int
    mean_abs: float
    psnr: float
    ssim: float | None = None

    @property
    def identical(self) -> bool:
        return self.max_abs == 0


def psnr_uint8(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8 arrays of one shape (peak 255, MSE over every value); inf if equal."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(255.0**2 / mse)


def ssim_uint8(a: np.ndarray, b: np.ndarray) -> float | None:
    """Mean per-frame SSIM of uint8 frames [T, H, W, 3] (scikit-image, Wang et al.'s Gaussian window).

    Colour channels are averaged (channel_axis); data range 255. None when H or W < 3.
    """
    side = min(a.shape[1], a.shape[2])
    if side < SSIM_MIN_SIDE:
        return None
    # skimage derives the Gaussian window from sigma (11 x 11 at 1.5); small frames get a smaller window.
    window = min(11, side if side % 2 else side - 1)
    options = dict(data_range=255, channel_axis=-1, gaussian_weights=True, sigma=1.5)
    options["use_sample_covariance"] = False  # the paper's statistics, as the reference MATLAB code
    if window < 11:
        options["win_size"] = window
        options["gaussian_weights"] = False  # a uniform window of that size (the Gaussian is fixed at 11)
    scores = [structural_similarity(x, y, **options) for x, y in zip(a, b, strict=True)]
    return float(np.mean(scores))


def frame_diff(a: np.ndarray, b: np.ndarray) -> FrameDiff:
    """Compare uint8 frames [T, H, W, 3] exactly (SSIM only for that layout)."""
    if a.shape != b.shape:
        raise ValidationError(f"cannot compare frames of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != np.uint8 or b.dtype != np.uint8:
        raise ValidationError(f"frames must be uint8, got {a.dtype} and {b.dtype}")
    delta = np.abs(a.astype(np.int16) - b.astype(np.int16))
    video = a.ndim == 4 and a.shape[-1] == 3
    return FrameDiff(
        max_abs=int(delta.max()),
        mean_abs=float(delta.mean()),
        psnr=psnr_uint8(a, b),
        ssim=ssim_uint8(a, b) if video else None,
    )
