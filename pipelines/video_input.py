"""Input videos (VACE's control video and mask): read, checked and hashed once, as the request holds them.

A video is a path read with imageio (the library outputs are written with): a video file (mp4
through imageio-ffmpeg, an animated GIF, a multi-page TIFF), a single image (one frame), or a
directory of PNG / JPEG / WebP frames taken in name order; or a uint8 array [T, H, W, 3] (a mask
may also be [T, H, W]) from Python. Frames become RGB uint8 [T, H, W, 3] (grey repeated, alpha
dropped). Nothing here resamples: frame count and size are checked against the request when the
pipeline prepares it. Torch-free, so the CLI and renders check files before any model loads.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmgen.errors import ValidationError
from pipelines.checks import MAX_PIXELS, MAX_REFERENCE_IMAGES
from pipelines.image_input import IMAGE_SUFFIXES


@dataclass(frozen=True, eq=False)
class VideoInput:
    """RGB frames uint8 [T, H, W, 3] (read-only), where they came from, and their sha256.

    sha256: of the decoded frames by the frames_sha256 recipe (header "|u1|T,H,W,3\\n" then the
    bytes), so a file and the same frames passed as an array hash alike.
    """

    frames: np.ndarray
    source: str
    sha256: str

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def height(self) -> int:
        return int(self.frames.shape[1])

    @property
    def width(self) -> int:
        return int(self.frames.shape[2])


def read_video(value: Any, *, field: str = "video", max_pixels: int | None = None) -> VideoInput:
    """A path (see the module docstring) or a uint8 array [T, H, W, 3] (or [T, H, W]) -> VideoInput.

    A VideoInput (already read: a request copied with new values) is returned as it is; errors are
    one line naming `field`. max_pixels: decoding a file stops with an error once its frames hold more
    than this many pixels (frames x height x width; a server's bound on what an upload may become;
    None: MAX_PIXELS, the most any request makes, so a small file of many frames is no memory blow-up).
    """
    if isinstance(value, VideoInput):
        return value
    if isinstance(value, (str, Path)):
        budget = _Budget(field, MAX_PIXELS if max_pixels is None else max_pixels)
        return _make(_read_path(Path(value), field, budget), str(value), field)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim not in (3, 4) or (value.ndim == 4 and value.shape[3] != 3):
            raise ValidationError(
                f"{field}: an array must be uint8 [T, H, W, 3] (RGB) or [T, H, W] (grey), "
                f"got {value.dtype} {list(value.shape)}"
            )
        return _make(_rgb(value), "array", field)
    raise ValidationError(
        f"{field}: expected a video path or a uint8 [T, H, W, 3] array, got {type(value).__name__}"
    )


@dataclass
class _Budget:
    """The pixels one read_video call may decode and those decoded so far."""

    field: str
    limit: int
    used: int = 0

    def take(self, frame: np.ndarray) -> None:
        self.used += frame.shape[0] * frame.shape[1]
        if self.used > self.limit:
            raise ValidationError(
                f"{self.field}: decodes to more than {self.limit} pixels (frames x height x width), the "
                "most one input may hold here (a request's bound, or a server's --max-pixels); send "
                "fewer or smaller frames"
            )


def _read_path(path: Path, field: str, budget: _Budget) -> np.ndarray:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise ValidationError(
                f"{field}: {path}: a directory without frames ({', '.join(IMAGE_SUFFIXES)})"
            )
        frames = [_read_frames(file, field, budget) for file in files]
        sizes = {frame.shape[1:] for frame in frames}
        if len(sizes) != 1:
            raise ValidationError(f"{field}: {path}: frames of different sizes {sorted(sizes)}")
        return np.concatenate(frames)
    if not path.is_file():
        raise ValidationError(f"{field}: {path}: file not found")
    return _read_frames(path, field, budget)


def _read_frames(path: Path, field: str, budget: _Budget) -> np.ndarray:
    import imageio.v3 as iio

    frames = []
    try:
        for frame in iio.imiter(path):
            frames.append(np.asarray(frame))
            budget.take(frames[-1])
    except ValidationError:
        raise
    except Exception as err:  # imageio raises OSError, ValueError, its plugins' own errors
        raise ValidationError(
            f"{field}: {path}: not a readable video or image ({type(err).__name__})"
        ) from err
    if not frames:
        raise ValidationError(f"{field}: {path}: no frames")
    try:
        return _rgb(np.stack([_frame_rgb(frame) for frame in frames]))
    except ValueError as err:
        raise ValidationError(f"{field}: {path}: frames of different sizes or kinds ({err})") from err


def _frame_rgb(frame: np.ndarray) -> np.ndarray:
    if frame.dtype != np.uint8:
        raise ValueError(f"{frame.dtype} pixels, expected 8-bit")
    if frame.ndim == 3 and frame.shape[2] in (1, 3, 4):
        frame = frame[..., :3] if frame.shape[2] != 1 else frame[..., 0]
    if frame.ndim == 2:
        frame = np.repeat(frame[..., None], 3, axis=2)
    if frame.ndim != 3:
        raise ValueError(f"frame of shape {list(frame.shape)}")
    return frame


def _rgb(frames: np.ndarray) -> np.ndarray:
    if frames.ndim == 3:
        frames = np.repeat(frames[..., None], 3, axis=3)
    return np.ascontiguousarray(frames)


def _make(frames: np.ndarray, source: str, field: str) -> VideoInput:
    if 0 in frames.shape:
        raise ValidationError(f"{field}: empty frames {list(frames.shape)}")
    frames = frames.copy()  # the caller's array stays writeable; ours is read-only
    frames.flags.writeable = False
    digest = hashlib.sha256(f"|u1|{','.join(map(str, frames.shape))}\n".encode())
    digest.update(memoryview(frames).cast("B"))
    return VideoInput(frames=frames, source=source, sha256=digest.hexdigest())


def read_reference_images(value: Any, *, field: str = "reference_images") -> tuple[Any, ...]:
    """One path / uint8 [H, W, 3] array, or a list of at most MAX_REFERENCE_IMAGES of them -> a tuple
    of ImageInput (each read once)."""
    from pipelines.image_input import ImageInput, read_image

    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(items) > MAX_REFERENCE_IMAGES:  # counted before any is read
        raise ValidationError(f"{field}: {len(items)} images; at most {MAX_REFERENCE_IMAGES}")
    return tuple(item if isinstance(item, ImageInput) else read_image(item, field=field) for item in items)
