"""VACE's control input, prepared as diffusers' WanVACEPipeline prepares it: pure functions of tensors.

Inputs, all for one video (diffusers' pipeline takes one):
- video: pixels [1, 3, T, H, W] in [-1, 1] (T = 4k + 1 frames); zeros where no control video is given.
- mask: [1, C, T, H, W] in [0, 1] (C = 1 or 3; 1 = regenerate, 0 = keep); ones where none is given.
- references: reference images, each a canvas [3, H, W] in [-1, 1] (reference_canvas).
- encode: the VAE as a function, pixels [1, 3, T, H, W] -> normalized latents [1, z_dim, T', H/8, W/8]
  (the distribution's mode, (latent - mean) / std, as pipelines.conditioning.encode_condition).

The result (vace_control) is the model's control input [1, 2 * z_dim + 64, R + T', H/8, W/8] (96
channels for Wan2.1 VACE): the inactive latents (the kept pixels), the reactive latents (the pixels to
regenerate), then the mask packed to latent size; the R reference latents go first in time, in the
order given (the first reference at frame 0), with zeros for their reactive half and their mask.

Reference order: the model's is the original VACE code's (ali-vilab/VACE, Wan2.1's wan/vace.py:
`torch.cat([*ref_latent, latent], dim=1)`, the list as given), which trained the checkpoints.
diffusers' WanVACEPipeline prepends one reference at a time, so the last one given ends first: the
same frames as mmgen's for the list reversed. One order for both checkpoint layouts.
The denoised latents carry the R reference frames too; drop_references takes them off before decode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mmgen.errors import ValidationError

Encode = Callable[[torch.Tensor], torch.Tensor]
VAE_TEMPORAL = 4  # pixel frames per latent frame (after the first)
VAE_SPATIAL = 8  # pixels per latent row / column


@dataclass(frozen=True)
class VACEControl:
    """One request's control input, built once: latents [1, C, R + T', H', W'] and its R reference frames."""

    latents: torch.Tensor
    references: int

    def drop_references(self, latents: torch.Tensor) -> torch.Tensor:
        """Denoised latents [B, z_dim, R + T', H', W'] -> [B, z_dim, T', H', W'] (the generated frames)."""
        return latents[:, :, self.references :]


def vace_control(
    encode: Encode,
    video: torch.Tensor,
    mask: torch.Tensor,
    references: Sequence[torch.Tensor] = (),
    *,
    patch: int = 2,
    spatial: int = VAE_SPATIAL,
    temporal: int = VAE_TEMPORAL,
) -> VACEControl:
    """The control input of one request (see the module docstring); patch: the DiT's spatial patch size;
    spatial / temporal: the VAE's scale factors (Wan2.1's 8 and 4 by default)."""
    latents = video_latents(encode, video, mask, references)
    packed = packed_mask(mask, len(references), patch=patch, spatial=spatial, temporal=temporal)
    packed = packed.to(latents.dtype)
    return VACEControl(torch.cat([latents, packed], dim=1), len(references))


def video_latents(
    encode: Encode, video: torch.Tensor, mask: torch.Tensor, references: Sequence[torch.Tensor] = ()
) -> torch.Tensor:
    """video [1, 3, T, H, W], mask [1, C, T, H, W], references [3, H, W] each -> [1, 2 * z_dim, R + T', H', W'].

    The mask is made binary (> 0.5) for this split; the arithmetic runs in video's dtype (diffusers:
    the VAE's), so pass the pixels in the dtype the VAE encodes.
    """
    _check_video(video, mask)
    binary = (mask > 0.5).to(video.dtype)
    inactive = encode(video * (1 - binary))
    reactive = encode(video * binary)
    latents = torch.cat([inactive, reactive], dim=1)
    leading = []
    for reference in references:
        if tuple(reference.shape) != (3, *video.shape[3:]):
            raise ValidationError(
                f"a reference image must be a canvas [3, {video.shape[3]}, {video.shape[4]}] (the video's size), "
                f"got {list(reference.shape)}"
            )
        latent = encode(reference.to(video.dtype)[None, :, None])  # [1, z_dim, 1, H', W']
        leading.append(torch.cat([latent, torch.zeros_like(latent)], dim=1))  # no reactive half: zeros
    return torch.cat([*leading, latents], dim=2)  # the references in the order given, then the video


def packed_mask(
    mask: torch.Tensor,
    references: int = 0,
    *,
    patch: int = 2,
    spatial: int = VAE_SPATIAL,
    temporal: int = VAE_TEMPORAL,
) -> torch.Tensor:
    """mask [1, C, T, H, W] (its first channel, as given: not made binary) -> [1, 64, R + T', H/8, W/8].

    Each 8 x 8 pixel tile becomes 64 channels at its latent position; frames are resampled to the
    latent frame count ceil(T / 4) by nearest-exact interpolation; R zero frames go first for the
    references. H and W must be multiples of 8 * patch. (8 and 4: `spatial` and `temporal`, the
    VAE's scale factors; a VAE with others packs spatial**2 channels.)
    """
    if mask.dim() != 5 or mask.shape[0] != 1:
        raise ValidationError(f"mask must be [1, C, T, H, W], got {list(mask.shape)}")
    _, _, frames, height, width = mask.shape
    multiple = spatial * patch
    if height % multiple or width % multiple:
        raise ValidationError(
            f"mask height and width must be multiples of {multiple}, got {height} x {width}"
        )
    rows, cols = height // spatial, width // spatial
    tiles = mask[0, 0].reshape(frames, rows, spatial, cols, spatial)
    tiles = tiles.permute(2, 4, 0, 1, 3).reshape(spatial**2, frames, rows, cols)
    latent_frames = -(-frames // temporal)
    packed = F.interpolate(tiles[None], size=(latent_frames, rows, cols), mode="nearest-exact")
    if references:
        packed = torch.cat([packed.new_zeros(1, spatial**2, references, rows, cols), packed], dim=2)
    return packed


def reference_canvas(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """image [3, h, w] in [-1, 1] -> [3, height, width]: scaled to fit (bilinear), centred on white."""
    if image.dim() != 3 or image.shape[0] != 3:
        raise ValidationError(f"a reference image must be [3, h, w], got {list(image.shape)}")
    scale = min(height / image.shape[1], width / image.shape[2])
    new_h, new_w = int(image.shape[1] * scale), int(image.shape[2] * scale)
    resized = F.interpolate(image[None], size=(new_h, new_w), mode="bilinear", align_corners=False)[0]
    top, left = (height - new_h) // 2, (width - new_w) // 2
    canvas = image.new_ones(3, height, width)
    canvas[:, top : top + new_h, left : left + new_w] = resized
    return canvas


def _check_video(video: torch.Tensor, mask: torch.Tensor) -> None:
    if video.dim() != 5 or video.shape[:2] != (1, 3):
        raise ValidationError(f"video must be [1, 3, T, H, W], got {list(video.shape)}")
    if (
        mask.dim() != 5
        or mask.shape[0] != 1
        or mask.shape[1] not in (1, 3)
        or mask.shape[2:] != video.shape[2:]
    ):
        raise ValidationError(
            f"mask must be [1, 1 or 3, {', '.join(map(str, video.shape[2:]))}] (the video's frames and size), "
            f"got {list(mask.shape)}"
        )
