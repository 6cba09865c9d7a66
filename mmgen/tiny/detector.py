"""A fixed detector for the tiny world's videos: object colour, motion direction, background colour.

Pure functions of uint8 frames [T, H, W, 3]; no learned parts, so it can judge any model's output:
- background: the median colour of the border pixels over all frames, named by the nearest
  background colour (RGB distance);
- foreground: pixels far from that background colour; its colour is the saturation-weighted
  circular mean hue of those pixels, named by the nearest foreground hue;
- direction: the foreground centroid's least-squares velocity over the frames times the clip
  length; 'still' when it travels less than STILL_FRACTION of the frame, else the dominant axis.
`prompt_following_score(frames, prompt)` compares those with what the prompt names.
"""

from __future__ import annotations

import colorsys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import MappingProxyType

import numpy as np

from mmgen.tiny.world import BACKGROUNDS, COLOURS, parse_caption

FOREGROUND_DISTANCE = 60.0  # sum of |channel difference| (0..765) that makes a pixel foreground
MIN_FOREGROUND_PIXELS = 4  # a frame with fewer foreground pixels has no centroid
STILL_FRACTION = 0.12  # travel below this fraction of the frame size reads as "still"
HUES = MappingProxyType(
    {name: colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360 for name, rgb in COLOURS.items()}
)


@dataclass(frozen=True)
class Detection:
    """What the detector read from one clip; a field is None when the frames show no foreground."""

    colour: str | None
    direction: str | None
    background: str
    travel: tuple[float, float] | None  # centroid (dx, dy) over the clip, fraction of the frame size
    foreground_fraction: float


def detect(frames: np.ndarray) -> Detection:
    """uint8 frames [T, H, W, 3] -> Detection."""
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    pixels = frames.astype(np.float32)
    border = np.concatenate([pixels[:, 0], pixels[:, -1], pixels[:, :, 0], pixels[:, :, -1]], axis=1).reshape(
        -1, 3
    )
    bg_rgb = np.median(border, axis=0)
    background = _nearest(bg_rgb, BACKGROUNDS)
    mask = np.abs(pixels - bg_rgb).sum(-1) > FOREGROUND_DISTANCE  # [T, H, W]
    fraction = float(mask.mean())
    if mask.sum() < MIN_FOREGROUND_PIXELS:
        return Detection(None, None, background, None, fraction)
    direction, travel = _direction(mask)
    return Detection(_colour(pixels[mask]), direction, background, travel, fraction)


def _nearest(rgb: np.ndarray, palette: Mapping[str, tuple[int, int, int]]) -> str:
    return min(palette, key=lambda name: float(np.sum((np.asarray(palette[name]) - rgb) ** 2)))


def _colour(fg: np.ndarray) -> str:
    """Foreground pixels [N, 3] (0..255) -> the colour name of their saturation-weighted mean hue."""
    high, low = fg.max(-1), fg.min(-1)
    chroma = high - low
    safe = np.where(chroma > 0, chroma, 1.0)
    r, g, b = fg[:, 0], fg[:, 1], fg[:, 2]
    # The standard hexcone hue, vectorized (degrees).
    hue = (
        np.select(
            [high == r, high == g],
            [((g - b) / safe) % 6, (b - r) / safe + 2],
            (r - g) / safe + 4,
        )
        * 60.0
    )
    weight = chroma  # grey edge pixels blended with the background carry little weight
    angle = np.deg2rad(hue)
    mean = np.rad2deg(np.arctan2((weight * np.sin(angle)).sum(), (weight * np.cos(angle)).sum())) % 360
    return min(HUES, key=lambda name: _hue_distance(mean, HUES[name]))


def _hue_distance(a: float, b: float) -> float:
    d = abs(a - b) % 360
    return min(d, 360 - d)


def _direction(mask: np.ndarray) -> tuple[str | None, tuple[float, float] | None]:
    frames, height, width = mask.shape
    ys, xs = np.mgrid[0:height, 0:width]
    t, cx, cy = [], [], []
    for i in range(frames):
        count = mask[i].sum()
        if count >= MIN_FOREGROUND_PIXELS:
            t.append(i)
            cx.append((xs * mask[i]).sum() / count / width)
            cy.append((ys * mask[i]).sum() / count / height)
    if len(t) < 2:
        return None, None
    times = np.asarray(t, dtype=np.float64)
    # Least-squares slope per frame, times the clip length: robust to one odd frame.
    dx, dy = (np.polyfit(times, np.asarray(c), 1)[0] * (frames - 1) for c in (cx, cy))
    travel = (float(dx), float(dy))
    if max(abs(dx), abs(dy)) < STILL_FRACTION:
        return "still", travel
    if abs(dx) >= abs(dy):
        return ("right" if dx > 0 else "left"), travel
    return ("down" if dy > 0 else "up"), travel


def prompt_following_score(frames: np.ndarray, prompt: str) -> dict:
    """How far uint8 frames [T, H, W, 3] follow `prompt`: per attribute the prompt names, whether the
    detector agrees; 'score' is the fraction of named attributes that agree (None when it names none),
    'colour_and_direction' whether both agree (False when the prompt lacks either).
    """
    expected = parse_caption(prompt)
    detection = detect(frames)
    checks = {
        name: getattr(detection, name) == expected[name]
        for name in ("colour", "direction", "background")
        if expected[name] is not None
    }
    return {
        "expected": {k: expected[k] for k in ("colour", "direction", "background")},
        "detected": asdict(detection),
        "checks": checks,
        "score": sum(checks.values()) / len(checks) if checks else None,
        "colour_and_direction": bool(checks.get("colour")) and bool(checks.get("direction")),
    }
