"""Request checks shared by the pipelines, the CLI and batch renders; they import no torch.

Plain functions, each returning the checked value or raising a one-line ValidationError that names
the field, the value and what is allowed, so a CLI typo or a bad YAML job fails before any model
(or even torch) loads. The pipelines run them again with the loaded model's own multiples.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mmgen.errors import ValidationError

# Wan: the VAE downsamples 8x in space and 4x in time, and the DiT patchifies 2x2 in space.
SPATIAL_MULTIPLE = 16
TEMPORAL_STRIDE = 4
# torch.Generator.manual_seed takes [0, 2**64), but its CPU generator gives seeds s and s + 2**63 the
# same noise (tests/test_request.py checks it): the seeds that make distinct noise are [0, 2**63).
MAX_SEED = 2**63 - 1
# The schedulers' training grid has 1000 timesteps: more steps than that only repeat timesteps
# (UniPC's integer timesteps) or split them ever finer for no gain, while memory and time grow with
# the count (10**9 steps filled the server's memory in set_timesteps).
MAX_STEPS = 1000
# The most pixels one frame (height x width) and one request (num_frames x height x width) may have:
# what the VAE decodes and the DiT attends over grows with them (a 8192x8192 frame alone needs ~26 GB
# per full-size decoder activation in float32). Each bound is the largest output a supported family
# makes, with headroom: frames up to 2048x2048 (Qwen-Image-2.1 makes 1536x1536, Qwen-Image 1328x1328,
# Wan 1280x720), videos up to 129 frames of 1280x720 (Wan2.1/2.2 make 81 frames of 1280x720, Wan2.2
# TI2V-5B 121 of 1280x704). The server's --max-pixels may only lower the second.
MAX_FRAME_PIXELS = 2048 * 2048
MAX_PIXELS = 1280 * 720 * 129
# VACE reference images: each one is one more latent frame at the head of the video, outside
# MAX_PIXELS' count; the released examples use one to three.
MAX_REFERENCE_IMAGES = 8
# LoRAs per request: each is read and applied (unfused: kept beside the weights) per request; stacks
# in use hold a few (a style + a distillation LoRA).
MAX_LORAS = 16
PIXELS_HELP = "height x width at most 2048 x 2048; num_frames x height x width at most 129 x 1280 x 720"
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
    if not _is_int(value) or not 1 <= value <= MAX_STEPS:
        raise ValidationError(f"num_inference_steps = {value!r}: must be an integer in [1, {MAX_STEPS}]")
    return value


def check_pixels(height: int | None, width: int | None, num_frames: int | None) -> None:
    """Nothing, or a ValidationError naming the fields whose product passes MAX_FRAME_PIXELS or
    MAX_PIXELS. None (the model's default) is judged once the pipeline fills it in."""
    if height is None or width is None:
        return
    if height * width > MAX_FRAME_PIXELS:
        raise ValidationError(
            f"height x width = {height} x {width} = {height * width} pixels: at most {MAX_FRAME_PIXELS} "
            "(2048 x 2048) per frame"
        )
    if num_frames is not None and num_frames * height * width > MAX_PIXELS:
        raise ValidationError(
            f"num_frames x height x width = {num_frames} x {height} x {width} = "
            f"{num_frames * height * width} pixels: at most {MAX_PIXELS} (129 x 1280 x 720)"
        )


def check_guidance(value: Any, name: str = "guidance_scale") -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValidationError(f"{name} = {value!r}: must be a finite number >= 0")
    return float(value)


def check_seed(value: Any) -> int | None:
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_SEED):
        raise ValidationError(f"seed = {value!r}: must be an integer in [0, 2**63 - 1] or None")
    return value


def check_attention_backend(value: Any) -> str:
    from mmgen.attention import BACKEND_NAMES  # imports torch: only this check needs it

    if value not in BACKEND_NAMES:
        raise ValidationError(f"attention_backend = {value!r}: unknown; allowed: {', '.join(BACKEND_NAMES)}")
    return value


def check_output_path(path: Path | str, num_frames: int) -> Path:
    """An output path whose suffix is .mp4 or .png (one frame only); the writer creates its directory."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in OUTPUT_SUFFIXES and path.is_dir():
        raise ValidationError(
            f"output {str(path)!r} is a directory; name a file in it, e.g. {str(path / 'out.mp4')!r}"
        )
    if suffix not in OUTPUT_SUFFIXES:
        raise ValidationError(f"output {str(path)!r}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")
    if suffix == ".png" and num_frames != 1:
        raise ValidationError(
            f"output {str(path)!r}: a .png holds one frame, num_frames = {num_frames}; use .mp4"
        )
    return path


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def image_load_refusals(
    title: str, directory: Any, task: str, gpu_memory_gb: float | None, load_on_host: bool | None
) -> list[str]:
    """What an image family's loader (Qwen-Image's, Qwen-Image-2.1's) refuses before any weight loads,
    one line each: a task other than t2i; a GPU budget (their offload is chosen at load instead)."""
    refused = []
    if task != "t2i":
        refused.append(
            f"task {task!r}: {directory} is {title}, a text-to-image model; ask for an image (task t2i: "
            "`mmgen generate --out NAME.png` or `--frames 1`)"
        )
    if gpu_memory_gb is not None or load_on_host:
        refused.append(
            f"gpu_memory_gb / load_on_host: the {title} pipeline has no memory planner yet; give offload "
            "('model' or 'layer') when loading"
        )
    return refused


def offload_refusals(offload: str, request: Any) -> list[str]:
    """What a request asks of a pipeline whose offload was chosen at load (Qwen-Image's, Qwen-Image-2.1's)
    and that it cannot honour, one line each: another offload mode; unfused LoRAs under offload."""
    refused = []
    if request.offload not in (None, offload):
        refused.append(
            f"offload = {request.offload!r}: this pipeline was loaded with offload {offload!r} "
            "(chosen at load: from_pretrained(offload=...), `mmgen generate --offload`)"
        )
    if request.lora and offload != "none" and request.lora_mode != "fused":
        # Fused deltas go into the weights wherever they live (the host copies when offloaded);
        # unfused low-rank pairs would be new tensors the placement does not move.
        refused.append(f"lora_mode = {request.lora_mode!r}: with offload {offload!r} only 'fused' LoRAs run")
    return refused
