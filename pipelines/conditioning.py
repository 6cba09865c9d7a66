"""What a request conditions on: its text (UMT5), its image (VAE latents, CLIP tokens), as the loop takes them.

Numerically diffusers' WanPipeline / WanImageToVideoPipeline: the same text handling (each prompt's
hidden states, then zeros up to max_length), image preprocessing and latent normalization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmgen.attention.metadata import DiTAttention
from mmgen.models.umt5 import TextPadding
from pipelines.common import clean_prompt
from pipelines.denoise import Conditioning, TextBranch, split_branches
from pipelines.image_input import ImageInput, vae_pixels
from pipelines.memory import latent_stats
from pipelines.vace_conditioning import VAE_SPATIAL, VACEControl, reference_canvas, vace_control
from pipelines.video_input import VideoInput


@dataclass(frozen=True)
class ImageParts:
    """What an image adds to a request's Conditioning (see pipelines.denoise.Conditioning).

    concat [1, mask + z_dim, F', H', W'] (I2V); first_frame [1, z_dim, 1, H', W'] with
    first_frame_mask [1, 1, F', H', W'] (TI2V); image_embeds [1, N, image_dim] (Wan2.1 I2V).
    """

    concat: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None
    first_frame_mask: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None


@torch.no_grad()
def encode_text(
    pipeline: Any, prompts: list[str], max_length: int, block_stream: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> (UMT5 embeddings [B, max_length, d] in the DiT dtype, token counts int64 [B]).

    Wan's trained input: each prompt's own hidden states, then zeros up to max_length; the DiT
    attends to all of it densely (the counts matter only to a config with text_mask).
    block_stream: the layer placement's text stream (the encoder's layers from host memory), or None.
    """
    tokenizer, encoder = pipeline.components.tokenizer, pipeline.components.text_encoder
    ids, mask = tokenizer.encode([clean_prompt(p) for p in prompts], max_length)
    device = encoder.shared.weight.device
    padding = TextPadding.from_mask(mask.to(device))
    hidden = encoder(ids.to(device), padding, block_stream=block_stream)
    valid = padding.valid_mask(max_length).to(device)[..., None]
    hidden = torch.where(valid, hidden, torch.zeros((), dtype=hidden.dtype, device=device))
    return hidden.to(device=pipeline.device, dtype=pipeline.dtype), padding.lengths


@torch.no_grad()
def encode_image(pipeline: Any, image: ImageInput, height: int, width: int, num_frames: int) -> ImageParts:
    """The request's image -> what it adds to the Conditioning, as diffusers' WanImageToVideoPipeline builds it."""
    variant = pipeline.variant
    embeds = None
    if variant.image_embeddings:
        encoder = pipeline.components.image_encoder
        pixels = pipeline.components.image_preprocess(image.pil())
        device = encoder.embeddings.patch_embedding.weight.device
        embeds = encoder(pixels.to(device=device, dtype=encoder.dtype)).to(pipeline.device, pipeline.dtype)
    pixels = vae_pixels(image, height, width)[:, :, None]  # [1, 3, 1, H, W]
    _, _, frames, latent_h, latent_w = pipeline.latents_shape(height, width, num_frames)
    if variant.image_mode == "first_frame":
        latent = encode_condition(pipeline, pixels)
        mask = torch.ones(1, 1, frames, latent_h, latent_w, device=pipeline.device)
        mask[:, :, 0] = 0
        return ImageParts(first_frame=latent, first_frame_mask=mask, image_embeds=embeds)
    # I2V: the image, then black frames, encoded as one video; a mask marks the given frame.
    video = torch.cat([pixels, pixels.new_zeros(1, 3, num_frames - 1, *pixels.shape[3:])], dim=2)
    latent = encode_condition(pipeline, video)
    stride = variant.mask_channels
    mask = torch.zeros(1, 1, num_frames + stride - 1, latent_h, latent_w, device=pipeline.device)
    mask[:, :, :stride] = 1  # the first frame counts `stride` times: the VAE packs 4 frames per latent
    mask = mask.view(1, frames, stride, latent_h, latent_w).transpose(1, 2)
    return ImageParts(concat=torch.cat([mask, latent], dim=1), image_embeds=embeds)


@torch.no_grad()
def encode_control(pipeline: Any, request: Any) -> VACEControl:
    """A VACE request's control context (pipelines.vace_conditioning), as diffusers' WanVACEPipeline makes it.

    request: a prepared GenerationRequest (its video, mask and reference images already checked
    against its size and frame count). No video: zeros; no mask: generate everything (ones).
    """
    height, width, frames = request.height, request.width, request.num_frames
    vae_dtype = pipeline.vae.dtype
    if request.video is None:
        video = torch.zeros(1, 3, frames, height, width)
    else:
        video = 2.0 * _unit(request.video) - 1.0
    if request.mask is None:
        mask = torch.ones_like(video)
    else:  # diffusers: the mask read as an image in [-1, 1], then mapped back to [0, 1]
        mask = torch.clamp((2.0 * _unit(request.mask) - 1.0 + 1) / 2, min=0, max=1)
    spatial, temporal = pipeline.vae.config.scale_factor_spatial, pipeline.temporal_stride
    references = [
        reference_canvas(reference_pixels(image, spatial), height, width)
        for image in request.reference_images
    ]
    return vace_control(
        lambda pixels: encode_condition(pipeline, pixels),
        video.to(vae_dtype),
        mask.to(vae_dtype),
        references,
        patch=pipeline.transformer.config.patch_size[1],
        spatial=spatial,
        temporal=temporal,
    )


def _unit(video: VideoInput) -> torch.Tensor:
    """uint8 frames [T, H, W, 3] -> float32 [1, 3, T, H, W] in [0, 1] (x / 255, as diffusers' image processor)."""
    return (torch.from_numpy(video.frames.astype("float32")) / 255.0).permute(3, 0, 1, 2)[None]


def reference_pixels(image: ImageInput, spatial: int = VAE_SPATIAL) -> torch.Tensor:
    """A reference image -> float32 [3, h, w] in [-1, 1]; sides floored to a multiple of `spatial` first.

    diffusers' VaeImageProcessor.preprocess(image, None, None): the image's own size, each side
    floored to the VAE's spatial factor (PIL Lanczos), resized only when that changes it.
    """
    from PIL import Image

    pil = image.pil()
    size = (image.width - image.width % spatial, image.height - image.height % spatial)
    if size != pil.size:
        pil = pil.resize(size, resample=Image.Resampling.LANCZOS)
    array = torch.from_numpy(np.asarray(pil).astype(np.float32) / 255.0)
    return 2.0 * array.permute(2, 0, 1) - 1.0


def encode_condition(pipeline: Any, video: torch.Tensor) -> torch.Tensor:
    """float32 pixels [1, 3, T, H, W] in [-1, 1] -> normalized latents [1, z_dim, T', H', W'] (float32)."""
    vae = pipeline.vae
    device = next(vae.parameters()).device
    latent = vae.encode(video.to(device=device, dtype=vae.dtype)).latent_dist.mode()
    latent = latent.to(pipeline.device, torch.float32)
    mean, inv_std = latent_stats(vae, latent.device, latent.dtype)
    return (latent - mean) * inv_std


def build_conditioning(
    pipeline: Any,
    text: torch.Tensor,
    text_lens: torch.Tensor,
    image: ImageParts | None = None,
    control: VACEControl | None = None,
    control_scale: float | tuple[float, ...] = 1.0,
) -> Conditioning:
    """Text [1 or 2 (cond, uncond), L, d] and its token counts [1 or 2] (+ image parts, + a VACE control
    context and its hint scale) -> the Conditioning.

    Metadata is a value built here once per request (the text never changes between steps): for
    the stacked branches and, when guided, for each branch alone (sequential / CFG-parallel steps).
    """
    masked = pipeline.transformer.config.text_mask
    lens = text_lens.to(pipeline.device)

    def metadata(rows: slice) -> DiTAttention:
        return pipeline.transformer.build_attention_metadata(
            lens[rows] if masked else None, text_len=text.shape[1]
        )

    image = ImageParts() if image is None else image
    embeds = None if image.image_embeds is None else image.image_embeds.expand(text.shape[0], -1, -1)
    both = TextBranch(text=text, metadata=metadata(slice(None)), image_embeds=embeds)
    halves = split_branches(both, lambda row: metadata(slice(row, row + 1))) if text.shape[0] == 2 else ()
    return Conditioning(
        both=both,
        halves=halves,
        concat=image.concat,
        first_frame=image.first_frame,
        first_frame_mask=image.first_frame_mask,
        control=None if control is None else control.latents.to(pipeline.device, pipeline.dtype),
        control_scale=control_scale,
        references=0 if control is None else control.references,
    )
