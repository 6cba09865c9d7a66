"""The conditioning image of I2V / TI2V requests: read, checked, hashed, sized and preprocessed.

Reading follows diffusers' load_image (EXIF orientation applied, converted to RGB), except that an
image with an alpha channel (or a transparent palette colour) keeps it as RGBA: Qwen-Image-2.1 reads
the four channels; `pil()` gives every other model the RGB it always read (the alpha dropped). The VAE
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

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
# The largest side an input image may have, checked from the file's header before decoding: every
# model resizes its input to about 1024 x 1024, and 8192 x 8192 (256 MiB as RGBA) stays under PIL's
# decompression-bomb limit, which would otherwise raise an error naming no field.
MAX_IMAGE_SIDE = 8192
# The most input images one request may give (Qwen-Image-2.1's condition images; every other model
# reads one). Each becomes about 4096 latent tokens at 1024 x 1024 plus its vision tokens in the text.
MAX_INPUT_IMAGES = 4


@dataclass(frozen=True, eq=False)
class ImageInput:
    """An RGB or RGBA image as uint8 pixels [H, W, 3 or 4], where it came from, and its sha256.

    sha256: of the decoded pixels, by the frames_sha256 recipe (header "|u1|H,W,C\\n" then the bytes),
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

    @property
    def has_alpha(self) -> bool:
        return int(self.pixels.shape[2]) == 4

    def pil(self, mode: str = "RGB") -> Any:
        """The image as PIL in `mode`: RGB (an alpha channel dropped, as a plain RGB read drops it) or RGBA
        (opaque where the image has no alpha)."""
        return Image.fromarray(self.pixels, mode="RGBA" if self.has_alpha else "RGB").convert(mode)


def read_image(value: Any, *, field: str = "image") -> ImageInput:
    """A path (PNG / JPEG / WebP) or a uint8 array [H, W, 3 or 4] -> ImageInput; one-line errors name
    `field`; a side over MAX_IMAGE_SIDE pixels is refused.

    An ImageInput (already read: a request copied with new values) is returned as it is.
    """
    if isinstance(value, ImageInput):
        return value
    if isinstance(value, (str, Path)):
        return _read_file(Path(value), field)
    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] not in (3, 4) or 0 in value.shape:
            raise ValidationError(
                f"{field}: an array must be uint8 [H, W, 3] (RGB) or [H, W, 4] (RGBA), got {value.dtype} "
                f"{list(value.shape)}"
            )
        _check_sides(field, "array", value.shape[1], value.shape[0])
        return _make(np.ascontiguousarray(value), "array")
    raise ValidationError(
        f"{field}: expected a file path or a uint8 [H, W, 3 or 4] array, got {type(value).__name__}"
    )


def _check_sides(field: str, source: Any, width: int, height: int) -> None:
    if max(width, height) > MAX_IMAGE_SIDE:
        raise ValidationError(
            f"{field}: {source}: {width}x{height} pixels; an input image is at most {MAX_IMAGE_SIDE} "
            "pixels a side"
        )


def _read_file(path: Path, field: str) -> ImageInput:
    if not path.is_file():
        raise ValidationError(f"{field}: {path}: file not found")
    try:
        with _quiet_bomb_warning(), Image.open(path) as opened:
            _check_sides(field, path, *opened.size)  # before decoding: the header's size
            alpha = opened.mode in ("RGBA", "LA", "PA") or "transparency" in opened.info
            image = ImageOps.exif_transpose(opened).convert("RGBA" if alpha else "RGB")
    except Image.DecompressionBombError as err:  # a size far past PIL's own bound: refused by Image.open
        raise ValidationError(
            f"{field}: {path}: over {2 * Image.MAX_IMAGE_PIXELS} pixels; an input image is at most "
            f"{MAX_IMAGE_SIDE} pixels a side"
        ) from err
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ValidationError(
            f"{field}: {path}: not a readable image ({type(err).__name__}); allowed: PNG, JPEG, WebP"
        ) from err
    return _make(np.asarray(image, dtype=np.uint8).copy(), str(path))


@contextlib.contextmanager
def _quiet_bomb_warning() -> Iterator[None]:
    # PIL warns from 89 M pixels as it opens a file; the side check right after says more, in one line.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        yield


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


def read_images(value: Any, *, field: str = "image") -> ImageInput | tuple[ImageInput, ...]:
    """One image (read_image's values) or a list of 1 to MAX_INPUT_IMAGES of them -> an ImageInput (one
    given, or a list of one) or a tuple of them (several, in order); one-line errors name `field`."""
    if not isinstance(value, (list, tuple)):
        return read_image(value, field=field)
    if not 1 <= len(value) <= MAX_INPUT_IMAGES:
        raise ValidationError(
            f"{field}: {len(value)} images given; give 1 to {MAX_INPUT_IMAGES} (several only where a model "
            "reads several)"
        )
    images = tuple(read_image(item, field=field) for item in value)
    return images[0] if len(images) == 1 else images


def images_of(value: ImageInput | tuple[ImageInput, ...] | None) -> tuple[ImageInput, ...]:
    """A request's `image` value as a tuple: () for none, (image,) for one, the images for several."""
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)
