"""Pieces the T2V and T2I pipelines share: the result record, prompt cleaning, frame conversion, export.

The request checks live in pipelines.checks (no torch import) and are re-exported here.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmgen.outputs.writers import write_png, write_video
from pipelines.checks import (  # re-exported: callers import the checks from here too
    MAX_SEED,
    OUTPUT_SUFFIXES,
    SPATIAL_MULTIPLE,
    TEMPORAL_STRIDE,
    check_attention_backend,
    check_guidance,
    check_num_frames,
    check_output_path,
    check_seed,
    check_size,
    check_steps,
)

__all__ = (
    "MAX_SEED",
    "OUTPUT_SUFFIXES",
    "SPATIAL_MULTIPLE",
    "TEMPORAL_STRIDE",
    "GenerationResult",
    "check_attention_backend",
    "check_guidance",
    "check_num_frames",
    "check_output_path",
    "check_seed",
    "check_size",
    "check_steps",
    "clean_prompt",
    "video_to_uint8",
    "write_frames",
)


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
    then float32, * 255 and round-half-to-even. Done where the frames are (each step one IEEE float32
    rounding: the same bits on a GPU as on the CPU), so a GPU copies the uint8 frames to the host, a
    quarter of float32's bytes, and the host does no per-pixel work (a 720p video: 224 M values).
    """
    frames = (video[0].permute(1, 0, 2, 3) * 0.5 + 0.5).clamp(0, 1)
    levels = frames.float().mul_(255).round_().to(torch.uint8)  # frames is fresh: in place is safe
    return levels.permute(0, 2, 3, 1).contiguous().cpu().numpy()


@dataclass(frozen=True, eq=False)
class GenerationResult:
    """One generation: uint8 frames [T, H, W, 3] (read-only; [1, H, W, 4] RGBA for Qwen-Image-2.1, whose
    VAE decodes an alpha channel: PNGs keep it, frames_sha256 covers all four), final latents
    [1, C, F', H/8, W/8] fp32 on the CPU, their sha256 identities, timings in seconds, the environment fingerprint, the attention
    provider per site, and the resolved arguments (JSON-ready) that reproduce it. memory: peak GPU
    memory in GiB per stage (text_encode, denoise, decode), measured like the timings; empty off CUDA.
    """

    frames: np.ndarray
    frames_sha256: str
    latents: torch.Tensor
    latents_sha256: str
    timings: dict[str, float]
    fingerprint: dict[str, Any]
    attention_providers: dict[str, str]
    args: dict[str, Any]
    memory: dict[str, float] = field(default_factory=dict)

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
