"""Pieces the T2V and T2I pipelines share: request checks, the result record, frame conversion, export.

The checks are plain functions so that a batch render can run the same rules on a whole YAML file
before any model loads.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmgen.attention import BACKEND_NAMES
from mmgen.errors import ValidationError
from mmgen.render.writers import write_png, write_video

# Wan: the VAE downsamples 8x in space and 4x in time, and the DiT patchifies 2x2 in space.
SPATIAL_MULTIPLE = 16
TEMPORAL_STRIDE = 4
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes any value in [0, 2**64)
OUTPUT_SUFFIXES = (".mp4", ".png")


def check_size(name: str, value: Any, multiple: int = SPATIAL_MULTIPLE) -> int:
    """A positive multiple of `multiple` (height, width), else a ValidationError with the nearest ones."""
    if not isinstance(value, int) or isinstance(value, bool) or value < multiple or value % multiple:
        lower = max(multiple, (value // multiple) * multiple) if _is_int(value) else multiple
        hint = f" (nearest: {lower} or {lower + multiple})" if _is_int(value) else ""
        raise ValidationError(f"{name} = {value!r}: must be a positive multiple of {multiple}{hint}")
    return value


def check_num_frames(value: Any, stride: int = TEMPORAL_STRIDE) -> int:
    """A frame count of the form stride*k + 1 (1, 5, 9, ... for Wan), else a ValidationError."""
    if not _is_int(value) or value < 1 or (value - 1) % stride:
        hint = ""
        if _is_int(value) and value > 1:
            lower = (value - 1) // stride * stride + 1
            hint = f" (nearest: {lower} or {lower + stride})"
        raise ValidationError(
            f"num_frames = {value!r}: must be {stride}k+1 (1, {1 + stride}, {1 + 2 * stride}, ...){hint}"
        )
    return value


def check_steps(value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ValidationError(f"num_inference_steps = {value!r}: must be an integer >= 1")
    return value


def check_guidance(value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValidationError(f"guidance_scale = {value!r}: must be a finite number >= 0")
    return float(value)


def check_seed(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_SEED):
        raise ValidationError(f"seed = {value!r}: must be an integer in [0, 2**64 - 1] or None")
    return value


def check_attention_backend(value: Any) -> str:
    if value not in BACKEND_NAMES:
        raise ValidationError(f"attention_backend = {value!r}: unknown; allowed: {', '.join(BACKEND_NAMES)}")
    return value


def check_output_path(path: Path | str, num_frames: int) -> Path:
    """An output path whose suffix is .mp4 or .png (one frame only); the writer creates its directory."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in OUTPUT_SUFFIXES:
        raise ValidationError(f"output {str(path)!r}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")
    if suffix == ".png" and num_frames != 1:
        raise ValidationError(
            f"output {str(path)!r}: a .png holds one frame, num_frames = {num_frames}; use .mp4"
        )
    return path


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def clean_prompt(text: str) -> str:
    """Unescape HTML entities and collapse whitespace, as Wan's and diffusers' prompt cleaning does.

    (Both also run ftfy.fix_text when ftfy is installed; mmgen does not, so the same prompt always
    gives the same tokens. ftfy only repairs mojibake, so ordinary text is unaffected.)
    """
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def video_to_uint8(video: torch.Tensor) -> np.ndarray:
    """Decoded VAE output [1, 3, T, H, W] in [-1, 1] -> uint8 frames [T, H, W, 3].

    Bit-for-bit diffusers' VideoProcessor path to PIL: (x / 2 + 0.5).clamp(0, 1) in the VAE's dtype,
    then float32 on the CPU, * 255 and round-half-to-even.
    """
    frames = (video[0].permute(1, 0, 2, 3) * 0.5 + 0.5).clamp(0, 1)
    array = frames.cpu().permute(0, 2, 3, 1).float().numpy()
    return (array * 255).round().astype(np.uint8)


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """One generation: uint8 frames [T, H, W, 3] (read-only), final latents [1, C, F', H/8, W/8] fp32 on
    the CPU, their sha256 identities, timings in seconds, the environment fingerprint, the attention
    provider per site, and the resolved arguments (JSON-ready) that reproduce it.
    """

    frames: np.ndarray
    frames_sha256: str
    latents: torch.Tensor
    latents_sha256: str
    timings: dict[str, float]
    fingerprint: dict[str, Any]
    attention_providers: dict[str, str]
    args: dict[str, Any]

    @property
    def image(self) -> np.ndarray:
        """The first frame [H, W, 3] (the whole output of a T2I pipeline)."""
        return self.frames[0]

    @property
    def fps(self) -> int:
        return int(self.args["fps"])

    def save(self, path: Path | str, *, fps: int | None = None) -> Path:
        """Write the frames atomically: .mp4 (H.264, yuv420p) or .png (one frame)."""
        return write_frames(self.frames, path, fps=self.fps if fps is None else fps)


def write_frames(frames: np.ndarray, path: Path | str, *, fps: int) -> Path:
    """uint8 frames [T, H, W, 3] -> an mp4 or (T == 1) a png at `path`, chosen by the suffix; atomic."""
    path = check_output_path(path, frames.shape[0])
    if path.suffix.lower() == ".png":
        return write_png(frames[0], path)
    return write_video(frames, path, fps=fps)
