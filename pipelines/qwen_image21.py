"""Qwen-Image-2.1: text-to-image and edits with condition images, as one family file.

What is this family's own, each a small function the shared prepare -> run -> record can call as a
hook (issue 35); `QwenImage21Pipeline.__call__` composes them into one generation for now:

- prompt template and prefix drop: `prompt_texts`, `encode_prompts` (transformers' Qwen3-VL, the
  vision tower reading the condition images; the last decoder layer's output before the final norm);
- condition images: `condition_size`, `prepare_condition` (RGBA, Lanczos resize, alpha over white
  for the text encoder, all four channels for the VAE), `condition_latents` (diffusers' VAE mode);
- noise and packing: `initial_noise` (a seeded CPU generator drawn as diffusers' randn_tensor);
- schedule: `make_schedule` (diffusers' FlowMatch Euler with its sigmas and the token-count shift);
- the model call: `denoise` (cond and uncond prompts as samples of one packed call; the prefix K/V
  filled at the first step and read by the later ones when use_kv_cache);
- decode: `decode` (diffusers' VAE, latents_mean/std, its uint8 conversion; RGBA images).

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

from mmgen.attention import select_attention
from mmgen.attention.impls import AttentionImpl
from mmgen.errors import ValidationError
from mmgen.loading.qwen_image21_dir import load_qwen_image21_components
from mmgen.models.qwen_image21 import PrefixCache, QwenImage21Transformer
from mmgen.models.qwen_image21_layout import BlockCausalLayout
from pipelines.common import video_to_uint8

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


def denoise(
    transformer: QwenImage21Transformer,
    attention: AttentionImpl,
    scheduler: Any,
    latents: torch.Tensor,
    prompts: PromptBatch,
    layout: BlockCausalLayout,
    *,
    condition: torch.Tensor | None,
    guidance: float | None,
    use_kv_cache: bool,
) -> torch.Tensor:
    """latents [B, N, C] -> the denoised latents, stepping every timestep the scheduler holds.

    prompts/layout hold B samples, or 2B with guidance (cond first, then uncond); condition [1, Nc, C]
    holds the condition images' tokens, shared by every sample."""
    samples = layout.batch
    cache = PrefixCache() if use_kv_cache else None  # this request's state: filled by the first call
    text = prompts.text.to(latents.device, transformer.dtype)
    for t in scheduler.timesteps:
        cached = cache is not None and cache.filled
        model_latents = latents.repeat(samples // latents.shape[0], 1, 1)
        if condition is not None and not cached:
            model_latents = torch.cat([condition.expand(samples, -1, -1), model_latents], dim=1)
        timestep = t.expand(samples).to(latents.dtype) / 1000
        with torch.no_grad():
            prediction = transformer(
                model_latents,
                timestep,
                None if cached else text,
                metadata=layout,
                attention=attention,
                cache=cache,
            )
        if guidance is not None:
            cond, uncond = prediction.chunk(2)
            prediction = uncond + guidance * (cond - uncond)
        latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
    return latents


@torch.no_grad()
def decode(vae: Any, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
    """Packed latents [B, N, C] -> uint8 images [B, height, width, 4] (RGBA, diffusers' rounding)."""
    batch, _, channels = latents.shape
    latents = latents.transpose(1, 2).reshape(batch, channels, 1, height // VAE_SCALE, width // VAE_SCALE)
    latents = latents.to(vae.dtype)
    mean, std = vae_latent_stats(vae, latents)
    decoded = vae.decode(latents * std + mean, return_dict=False)[0]
    return np.concatenate([video_to_uint8(decoded[b : b + 1]) for b in range(batch)])


@dataclass(frozen=True)
class QwenImage21Output:
    images: np.ndarray  # uint8 [B, H, W, 4]
    latents: torch.Tensor  # packed [B, N, C], the denoised latents before decoding


@dataclass(frozen=True)
class QwenImage21Pipeline:
    """The loaded parts: mmgen's transformer, transformers' Qwen3-VL and processor, diffusers' VAE and scheduler."""

    transformer: QwenImage21Transformer
    text_encoder: Any
    processor: Any
    vae: Any
    scheduler: Any
    attention: AttentionImpl
    sample_sigmas: tuple[float, ...] | None = None

    @staticmethod
    def from_pretrained(
        directory: str | Any,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype = torch.float32,
        attention: str = "auto",
    ) -> QwenImage21Pipeline:
        """A local diffusers-format directory (mmgen.loading.qwen_image21_dir); `attention`: a backend name."""
        parts = load_qwen_image21_components(directory, dtype=dtype, device=device, vae_dtype=vae_dtype)
        head_dim = parts.transformer.config.attention_head_dim
        return QwenImage21Pipeline(
            transformer=parts.transformer,
            text_encoder=parts.text_encoder,
            processor=parts.processor,
            vae=parts.vae,
            scheduler=parts.scheduler,
            attention=select_attention(attention, device=device, dtype=dtype, head_dim=head_dim),
            sample_sigmas=parts.sample_sigmas,
        )

    def __call__(
        self,
        prompt: str | Sequence[str],
        *,
        negative_prompt: str | Sequence[str] | None = None,
        image: Any = None,
        height: int | None = None,
        width: int | None = None,
        steps: int = DEFAULT_STEPS,
        guidance: float = 1.0,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        use_kv_cache: bool = True,
        resolution: int = DEFAULT_RESOLUTION,
        decode_images: bool = True,
    ) -> QwenImage21Output:
        """Generate one image per prompt; `image`: one condition image or a list, the same for every
        prompt; guidance > 1 with a negative prompt runs CFG (Qwen-Image-2.1 is CFG-distilled: 1.0).
        Noise: from `generator` (a CPU generator) or a generator seeded with `seed` (0 when neither)."""
        if generator is not None and seed is not None:
            raise ValidationError("pass either seed or generator, not both")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        images = [] if image is None else (list(image) if isinstance(image, (list, tuple)) else [image])
        conditions = [prepare_condition(item, resolution) for item in images]
        height, width = self._size(height, width, images, resolution)
        guided = guidance > 1 and negative_prompt is not None
        rows = encode_prompts(self.text_encoder, self.processor, prompts, [c[0] for c in conditions])
        if guided:
            negatives = (
                [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else negative_prompt
            )
            if len(negatives) != len(prompts):
                raise ValidationError(f"negative_prompt: {len(negatives)} given for {len(prompts)} prompts")
            rows += encode_prompts(self.text_encoder, self.processor, negatives, [c[0] for c in conditions])
        batch = PromptBatch.stack(rows)
        dtype = batch.text.dtype
        device = next(self.transformer.parameters()).device
        grids = [(1, p.shape[-2] // VAE_SCALE, p.shape[-1] // VAE_SCALE) for _, p in conditions]
        grids.append((1, height // VAE_SCALE, width // VAE_SCALE))
        layout = BlockCausalLayout.build(
            batch.text_lens, grids, text_width=batch.text.shape[1], slot_masks=batch.slot_masks, device=device
        )
        generator = generator or torch.Generator().manual_seed(seed or 0)
        latents = initial_noise(
            len(prompts), self.transformer.config.in_channels, height, width, generator, dtype
        )
        condition = condition_latents(self.vae, [p for _, p in conditions], dtype) if conditions else None
        make_schedule(self.scheduler, latents.shape[1], steps, self.sample_sigmas)
        latents = denoise(
            self.transformer,
            self.attention,
            self.scheduler,
            latents.to(device),
            batch,
            layout,
            condition=None if condition is None else condition.to(device),
            guidance=guidance if guided else None,
            use_kv_cache=use_kv_cache and self.transformer.config.causal_condition,
        )
        images = decode(self.vae, latents, height, width) if decode_images else np.zeros((0,), np.uint8)
        return QwenImage21Output(images, latents)

    @staticmethod
    def _size(height: int | None, width: int | None, images: list, resolution: int) -> tuple[int, int]:
        """The output size: given, else the last condition image's aspect at resolution**2, else square;
        sides must be multiples of 32 (refused, never rounded silently)."""
        if images and (height is None or width is None):
            last = images[-1]
            size = last.size if isinstance(last, Image.Image) else (last.shape[1], last.shape[0])
            auto_width, auto_height = condition_size(resolution, *size)
            height, width = height or auto_height, width or auto_width
        height, width = height or resolution, width or resolution
        for name, value in (("height", height), ("width", width)):
            if value % SIZE_MULTIPLE or value < SIZE_MULTIPLE:
                raise ValidationError(
                    f"{name}={value}: Qwen-Image-2.1 needs a positive multiple of {SIZE_MULTIPLE}"
                )
        return height, width
