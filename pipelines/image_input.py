"""The conditioning image of I2V / TI2V requests: read, checked, hashed, sized and preprocessed.

Reading follows diffusers' load_image (EXIF orientation applied, converted to RGB); the VAE
condition is resized as diffusers' VaeImageProcessor does for WanImageToVideoPipeline (PIL Lanczos
to exactly height x width, no crop, then [0, 255] -> [-1, 1]). Everything but `vae_pixels` is
torch-free, so the CLI and batch renders check images before any model loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from mmgen.errors import ValidationError
from pipelines.checks import MAX_INPUT_PIXELS

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass(frozen=True, eq=False)
class ImageInput:
    """An RGB image as uint8 pixels [H, W, 3], where it came from, and its sha256.

    sha256: of the decoded pixels, by the frames_sha256 recipe (header "|u1|H,W,3\\n" then the bytes),
    so a file and the same pixels passed as an array hash alike.
    """

    pixels: np.ndarray
    source: str
    sha256: str

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])

    def pil(self) -> Any:
        return Image.fromarray(self.pixels, mode="RGB")


def read_image(value: Any, *, field: str = "image") -> ImageInput:
    """A path (PNG / JPEG / WebP) or a uint8 array [H, W, 3] -> ImageInput; one-line errors name `field`.

    An ImageInput (already read: a request copied with new values) is returned as it is.
    """
    if isinstance(value, ImageInput):
        return value
    if isinstance(value, (str, Path)):
        return _read_file(Path(value), field)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3 or 0 in value.shape:
            raise ValidationError(
                f"{field}: an array must be uint8 [H, W, 3] (RGB), got {value.dtype} {list(value.shape)}"
            )
        return _make(np.ascontiguousarray(value), "array")
    raise ValidationError(
        f"{field}: expected a file path or a uint8 [H, W, 3] array, got {type(value).__name__}"
    )


def _read_file(path: Path, field: str) -> ImageInput:
    if not path.is_file():
        raise ValidationError(f"{field}: {path}: file not found")
    try:
        with _quiet_bomb_warning(), Image.open(path) as opened:
            if opened.size[0] * opened.size[1] > MAX_INPUT_PIXELS:  # the header's size, before decoding
                raise _too_many_pixels(f"{opened.size[0]}x{opened.size[1]}", field, path)
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except Image.DecompressionBombError as err:  # a size far past PIL's own bound: refused by Image.open
        raise _too_many_pixels(f"more than {MAX_INPUT_PIXELS}", field, path) from err
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ValidationError(
            f"{field}: {path}: not a readable image ({type(err).__name__}); allowed: PNG, JPEG, WebP"
        ) from err
    return _make(np.asarray(image, dtype=np.uint8).copy(), str(path))


@contextlib.contextmanager
def _quiet_bomb_warning() -> Iterator[None]:
    # PIL warns from 89 M pixels as it opens a file; the size check right after says more, in one line.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


def _too_many_pixels(size: str, field: str, path: Path) -> ValidationError:
    return ValidationError(
        f"{field}: {path}: {size} pixels; an input image may have at most {MAX_INPUT_PIXELS} (8192 x 8192)"
    )


def _make(pixels: np.ndarray, source: str) -> ImageInput:
    pixels.flags.writeable = False
    digest = hashlib.sha256(f"|u1|{','.join(map(str, pixels.shape))}\n".encode())
    digest.update(memoryview(pixels).cast("B"))
    return ImageInput(pixels=pixels, source=source, sha256=digest.hexdigest())


def size_for_image(image: ImageInput, area: int, multiple: int) -> tuple[int, int, str]:
    """(height, width, why): the image's aspect ratio at about `area` pixels, each side floored to `multiple`.

    diffusers' Wan I2V examples size requests this way (round(sqrt(area * h / w)) // m * m); used only
    when the caller gives neither height nor width. A side that floors to 0 is a ValidationError.
    """
    aspect = image.height / image.width
    height = round(math.sqrt(area * aspect)) // multiple * multiple
    width = round(math.sqrt(area / aspect)) // multiple * multiple
    if height < multiple or width < multiple:
        raise ValidationError(
            f"image {image.width}x{image.height} (aspect {aspect:.3g}) maps to {width}x{height} at ~{area} pixels, "
            f"not a valid grid (each side must be a positive multiple of {multiple}); pass height and width"
        )
    why = (
        f"image {image.width}x{image.height}: its aspect ratio at ~{area} pixels, "
        f"each side floored to a multiple of {multiple}"
    )
    return height, width, why


def resized_image(image: ImageInput, height: int, width: int) -> Any:
    """The image as a PIL RGB image of exactly height x width (Lanczos, no crop: VaeImageProcessor.resize)."""
    return image.pil().resize((width, height), resample=Image.Resampling.LANCZOS)


def vae_pixels(image: ImageInput, height: int, width: int) -> Any:
    """float32 [1, 3, height, width] in [-1, 1]: the image resized (Lanczos, no crop) for the VAE encoder."""
    array = np.asarray(resized_image(image, height, width), dtype=np.float32) / 255.0
    return torch.from_numpy(array.transpose(2, 0, 1).copy())[None] * 2.0 - 1.0
