"""Qwen-Image-2.1's own pieces: text-to-image and edits with condition images.

What is this family's own, each a small function its hooks (pipelines.qwen_image21_family, on the
shared prepare -> run -> record) call:

- prompt template and prefix drop: `prompt_texts`, `encode_prompts` (transformers' Qwen3-VL, the
  vision tower reading the condition images; the last decoder layer's output before the final norm);
- condition images: `condition_size`, `prepare_condition` (RGBA, Lanczos resize, alpha over white
  for the text encoder, all four channels for the VAE), `condition_latents` (diffusers' VAE mode);
- noise and packing: `initial_noise` (a seeded CPU generator drawn as diffusers' randn_tensor);
- schedule: `make_schedule` (diffusers' FlowMatch Euler with its sigmas and the token-count shift);
- decode: `vae_latent_stats` (diffusers' latents_mean/std; the family decodes RGBA images).

Everything here matches diffusers' QwenImage21Pipeline 0.42.1 for the same seed, except that prompts
of different lengths in one call are packed without padding: each prompt's image equals the same
prompt's image alone (diffusers pads to the longest prompt, which moves the shorter prompts' image
positions; see mmgen.models.qwen_image21_layout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmgen.errors import ValidationError

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
IMAGE_PAD = "<|image_pad|>"
VAE_SCALE = 16  # the VAE's spatial factor; one latent token covers 16 x 16 pixels
SIZE_MULTIPLE = 2 * VAE_SCALE  # sides are multiples of 32 (the text encoder's 2x2 image slots)
DEFAULT_RESOLUTION = 1024
DEFAULT_STEPS = 40


def prompt_texts(prompts: Sequence[str], images: int) -> list[str]:
    """The raw template strings diffusers tokenizes (not apply_chat_template: they tokenize differently);
    `images` condition images add their vision slots before the prompt."""
    user = " ".join(f"<image{i}><|vision_start|>{IMAGE_PAD}<|vision_end|>" for i in range(1, images + 1))
    head = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{user}"
    # Qwen has no BOS token: an empty prompt would leave the encoder nothing to read.
    return [f"{head}{prompt or ' '}<|im_end|>\n<|im_start|>assistant\n" for prompt in prompts]


def system_prefix_tokens(processor: Any) -> int:
    """How many leading tokens (the system turn) are dropped: its length under the processor's chat template."""
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    return len(processor.apply_chat_template(message, tokenize=True, return_dict=False)[0])


@dataclass(frozen=True)
class PromptBatch:
    """Encoded prompts: text [B, L, D] from column 0 (text_lens[b] valid), slot_masks bool [B, L] (True
    at image slots, whose states the condition images' latent tokens replace)."""

    text: torch.Tensor
    text_lens: tuple[int, ...]
    slot_masks: torch.Tensor

    @staticmethod
    def stack(rows: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> PromptBatch:
        """rows: per prompt (states [L_b, D], slots bool [L_b]) -> one right-padded batch."""
        width = max(states.shape[0] for states, _ in rows)
        text = rows[0][0].new_zeros(len(rows), width, rows[0][0].shape[1])
        slots = torch.zeros(len(rows), width, dtype=torch.bool)
        for b, (states, mask) in enumerate(rows):
            text[b, : states.shape[0]] = states
            slots[b, : mask.shape[0]] = mask.cpu()
        return PromptBatch(text, tuple(states.shape[0] for states, _ in rows), slots)


@torch.no_grad()
def encode_prompts(text_encoder: Any, processor: Any, prompts: Sequence[str], images: Sequence[Any]) -> list:
    """prompts (one processor call, left-padded as diffusers) + the condition images (PIL RGB, the same
    set for every prompt) -> per prompt (states [L_b, D], slots [L_b]), the system prefix dropped.

    The states are the last decoder layer's output *before* the language model's final norm (what the
    transformer was trained on; transformers 5 returns the normed one as hidden_states[-1]), read by a
    pre-hook on that norm for this call only."""
    device = next(text_encoder.parameters()).device
    kwargs: dict[str, Any] = {"text": prompt_texts(prompts, len(images)), "padding": True}
    if images:
        kwargs["images"] = [image for _ in prompts for image in images]
    inputs = processor(**kwargs, padding_side="left", return_tensors="pt").to(device)
    forward = {"input_ids": inputs.input_ids, "attention_mask": inputs.attention_mask}
    for name in ("pixel_values", "image_grid_thw", "mm_token_type_ids"):
        if name in inputs:
            forward[name] = inputs[name]
    language_model = getattr(text_encoder.model, "language_model", text_encoder.model)
    captured: list[torch.Tensor] = []
    handle = language_model.norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        text_encoder(**forward)
    finally:
        handle.remove()
    drop = system_prefix_tokens(processor)
    image_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    rows = []
    for states, ids, mask in zip(captured[-1], inputs.input_ids, inputs.attention_mask.bool(), strict=True):
        rows.append((states[mask][drop:], (ids[mask] == image_id)[drop:]))
    return rows


def condition_size(resolution: int, width: int, height: int) -> tuple[int, int]:
    """(width, height) of area resolution**2 at the image's aspect ratio, each rounded to 32 (diffusers)."""
    ratio = width / height
    new_width = math.sqrt(resolution * resolution * ratio)
    return round(new_width / 32) * 32, round(new_width / ratio / 32) * 32


def prepare_condition(image: Any, resolution: int) -> tuple[Any, torch.Tensor]:
    """A condition image (PIL or uint8 array) -> (PIL RGB for the text encoder, VAE pixels [1, 4, 1, h, w]
    in [-1, 1]): RGBA, resized (Lanczos, no crop) to condition_size; the encoder's copy has the alpha
    composited over white, the VAE reads all four channels."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise ValidationError(f"image: expected a PIL image or a uint8 array, got {type(image).__name__}")
    rgba = image.convert("RGBA") if image.mode != "RGBA" else image
    width, height = condition_size(resolution, *rgba.size)
    resized = rgba.resize((width, height), resample=Image.Resampling.LANCZOS)
    encoder_image = Image.new("RGB", resized.size, (255, 255, 255))
    encoder_image.paste(resized, mask=resized.getchannel("A"))
    array = np.asarray(resized, dtype=np.float32) / 255.0
    pixels = torch.from_numpy(array.transpose(2, 0, 1).copy())[None, :, None] * 2.0 - 1.0
    return encoder_image, pixels


def vae_latent_stats(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    channels = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, h, w] (or [B, 1, C, h, w]) latents -> tokens [B, h * w, C] (2.1 does not patchify)."""
    return latents.reshape(latents.shape[0], -1, latents.shape[-2] * latents.shape[-1]).transpose(1, 2)


@torch.no_grad()
def condition_latents(vae: Any, pixels: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """VAE pixels [1, 4, 1, h, w] per condition image -> normalized latent tokens [1, sum h*w/256, C]."""
    device = next(vae.parameters()).device
    tokens = []
    for image in pixels:
        latents = vae.encode(image.to(device, dtype)).latent_dist.mode()
        mean, std = vae_latent_stats(vae, latents)
        tokens.append(pack((latents - mean) / std))
    return torch.cat(tokens, dim=1)


def initial_noise(
    batch: int, channels: int, height: int, width: int, generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """Packed noise [B, N, C], drawn on the CPU as diffusers' randn_tensor draws (B, 1, C, h, w)."""
    shape = (batch, 1, channels, height // VAE_SCALE, width // VAE_SCALE)
    return pack(torch.randn(shape, generator=generator, dtype=dtype))


def make_schedule(
    scheduler: Any, image_tokens: int, steps: int, sigmas: Sequence[float] | None
) -> torch.Tensor:
    """Set the scheduler's timesteps for `image_tokens` target tokens (diffusers' linear mu); returns them."""
    if sigmas is None:
        sigmas = np.linspace(1.0, 1 / steps, steps)
    config = scheduler.config
    base, top = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    low, high = config.get("base_shift", 0.5), config.get("max_shift", 1.15)
    slope = (high - low) / (top - base)
    scheduler.set_timesteps(sigmas=list(sigmas), mu=image_tokens * slope + low - slope * base)
    scheduler.set_begin_index(0)
    return scheduler.timesteps
