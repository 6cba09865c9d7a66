"""Qwen-Image-Edit: a GenerationRequest with an image -> plan -> denoise beside the image's tokens -> image.

Numerically this is diffusers' QwenImageEditPipeline (the first release, Qwen/Qwen-Image-Edit):

- The input image is resized (PIL Lanczos) to its aspect ratio at about 1024 x 1024 pixels, each side
  rounded to a multiple of 32 (diffusers' calculate_dimensions); that one resized image goes both to
  the VAE and to the text encoder. The output size defaults to the same (height/width may differ).
- The text encoder is the whole Qwen2.5-VL: Qwen2-VL's image processor cuts the resized image into
  patches, the prompt's single <|image_pad|> becomes one pad per merged patch, and the encoder's last
  hidden states, less the Edit template's system prefix (64 tokens under Qwen's tokenizer), are the
  text. The vision tokens stay in that text.
- The image's VAE latents (the posterior's mode, normalized by the VAE's latents_mean / latents_std),
  packed as the noise is, follow the noise tokens in every transformer call; RoPE gives the noise
  grid frame index 0 and the image grid frame index 1 (plan.grids); the prediction is cut back to the
  noise tokens. Schedule (mu from the noise tokens only), true CFG, decode: as T2I.

It is QwenImagePipeline (pipelines.qwen_image) with Edit's hooks (QwenImageEditHooks: the variant
hooks of pipelines.qwen_image_family.QwenImageHooks): one loop, one prepare/run/record, one request
value. One deliberate difference: diffusers never cuts the Edit text; here it is
cut at max_sequence_length like T2I's, whose Edit default is the largest allowed (1024), so the two
agree unless a prompt plus its image tokens is longer than that.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.loading.defaults import GenerationDefaults
from mmgen.loading.qwen_image_classes import EDIT_PIPELINE_CLASS
from mmgen.models.qwen_image_prompt import (
    EDIT_TEMPLATE,
    MAX_TEXT_TOKENS,
    expand_image_pads,
    templated_prompts,
)
from mmgen.models.qwen_image_text import QwenVisionTextEncoder
from pipelines.capabilities import Capabilities
from pipelines.family import Stage
from pipelines.image_input import ImageInput, resized_image, vae_pixels
from pipelines.plan import GenerationPlan
from pipelines.qwen_image import DEFAULTS, QwenImagePipeline
from pipelines.qwen_image_family import QwenImageHooks, pack_latents
from pipelines.request import GenerationRequest

TARGET_AREA = 1024 * 1024  # the pixels the input image is resized to, about (diffusers' calculate_dimensions)
SIZE_MULTIPLE = 32
IMAGE_FLAG_HELP = (
    "the image to edit: a PNG, JPEG or WebP path or a uint8 [H, W, 3] array; `--image` in the CLI"
)


def calculated_size(
    image: ImageInput, area: int = TARGET_AREA, multiple: int = SIZE_MULTIPLE
) -> tuple[int, int]:
    """(height, width): the image's aspect ratio at about `area` pixels, each side rounded to `multiple`
    (diffusers' calculate_dimensions, Python's round included). A side rounding to 0 is refused."""
    ratio = image.width / image.height
    width = math.sqrt(area * ratio)
    height = width / ratio
    width, height = round(width / multiple) * multiple, round(height / multiple) * multiple
    if width < multiple or height < multiple:
        raise ValidationError(
            f"image = {image.source!r}: {image.width}x{image.height} (aspect {ratio:.3g}) resizes to {width}x{height} "
            f"at ~{area} pixels; each side must be a positive multiple of {multiple}"
        )
    return height, width


class QwenImageEditHooks(QwenImageHooks):
    """Qwen-Image's hooks with an input image: required, sizes the output and the condition, is seen by
    the text encoder and rides beside the noise tokens as packed latents."""

    title = "Qwen-Image-Edit"

    # -- prepare --

    def refusals(self, pipeline: Any, request: GenerationRequest) -> list[str]:
        refused = super().refusals(pipeline, request)
        if request.image is None:
            refused.append(f"image: required by Qwen-Image-Edit ({IMAGE_FLAG_HELP})")
        return refused

    def variant_defaults(self, request: GenerationRequest) -> dict[str, Any]:
        """The output size of the input image's calculated size; the text cut at its largest (1024)."""
        height, width = calculated_size(request.image)
        return {"height": height, "width": width, "max_sequence_length": MAX_TEXT_TOKENS}

    def size_rule(self, request: GenerationRequest) -> str:
        """The input image's encoded size and the rule that made it (`mmgen generate` prints it)."""
        image, (height, width) = request.image, calculated_size(request.image)
        return (
            f"input image {image.width}x{image.height} encoded at {width}x{height} (its aspect ratio at "
            f"~{TARGET_AREA} pixels, sides rounded to {SIZE_MULTIPLE}; the output size unless given)"
        )

    def condition_size(self, request: GenerationRequest) -> tuple[int, int]:
        return calculated_size(request.image)

    # -- run --

    @torch.no_grad()
    def encode_text(
        self, pipeline: Any, plan: GenerationPlan, prompts: list[str], text_stream: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts, each with the resized input image -> (text [B, L, D] on the device, text_lens
        int64 [B] on the CPU)."""
        c = pipeline.components
        image = resized_image(plan.request.image, *self.condition_size(plan.request))
        vision = c.image_processor(images=image, return_tensors="pt")
        grid = vision["image_grid_thw"]  # [1, 3]: (frames, rows, cols) of vision patches
        pads = int(grid.prod()) // c.image_processor.merge_size**2
        ids = [
            c.tokenizer.encode(expand_image_pads(text, pads))
            for text in templated_prompts(prompts, EDIT_TEMPLATE)
        ]
        text, text_lens = c.text_encoder.encode(
            ids, vision["pixel_values"], grid, max_tokens=plan.request.max_sequence_length
        )
        return text.to(pipeline.device), text_lens

    @torch.no_grad()
    def encode_condition(self, pipeline: Any, plan: GenerationPlan, stage: Stage) -> torch.Tensor:
        """The resized input image -> its packed, normalized VAE latents [1, M, 4C] (model dtype, device)."""
        with stage("image_encode", "image_encode"), pipeline.placement.using("vae"):
            vae = pipeline.vae
            device = next(vae.parameters()).device
            pixels = vae_pixels(plan.request.image, *self.condition_size(plan.request))[:, :, None]
            z = vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode()  # [1, C, 1, H/8, W/8]
            shape = (1, vae.config.z_dim, 1, 1, 1)
            mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, z.dtype)
            std = torch.tensor(vae.config.latents_std).view(shape).to(device, z.dtype)
            return pack_latents((z - mean) / std).to(pipeline.device, pipeline.dtype)

    # -- record --

    def variant_args(self, plan: GenerationPlan) -> dict[str, Any]:
        height, width = self.condition_size(plan.request)
        return {"condition_size": [height, width]}


# The values a request leaves out: the height and width are the input image's calculated size
# (QwenImageEditHooks.variant_defaults); these are what the server shows when no image is known.
EDIT_DEFAULTS: GenerationDefaults = dataclasses.replace(
    DEFAULTS, chosen_by="diffusers' QwenImageEditPipeline defaults (height and width: the input image's)"
)


class QwenImageEditPipeline(QwenImagePipeline):
    """Qwen-Image-Edit: `pipe(prompt, negative_prompt=None, image=PATH_OR_ARRAY, **request fields)` or
    `pipe.generate(request)` returns a GenerationResult (from_pretrained loads an Edit directory)."""

    directory_class = EDIT_PIPELINE_CLASS
    variant = "edit"
    capabilities = Capabilities("image", ("edit",))
    hooks = QwenImageEditHooks()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        c = self.components
        if not isinstance(c.text_encoder, QwenVisionTextEncoder) or c.image_processor is None:
            raise ValidationError(
                "Qwen-Image-Edit needs the whole Qwen2.5-VL (a QwenVisionTextEncoder) and an image_processor "
                f"(Qwen2-VL's), got {type(c.text_encoder).__name__} and {type(c.image_processor).__name__}"
            )

    @property
    def defaults(self) -> GenerationDefaults:
        return EDIT_DEFAULTS
