"""What a loaded Wan model is (WanComponents), its generation defaults, and the checks across components.

Shared by both directory layouts: diffusers-format (mmgen.loading.diffusers_dir) and the original
Wan2.2 A14B layout (mmgen.loading.original_dir). A directory's generation defaults come from its
`mmgen_defaults.json` (mmgen.loading.defaults.GenerationDefaults), else from the variant its configs mark.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgen.errors import LoadError
from mmgen.loading.defaults import GenerationDefaults
from mmgen.loading.safetensors_dir import read_json
from mmgen.loading.tokenizer import TextTokenizer
from mmgen.models.clip_vision import ClipImagePreprocess, ClipVisionEncoder
from mmgen.models.umt5 import UMT5Encoder
from mmgen.models.wan import WanDiT

DEFAULTS_FILE = "mmgen_defaults.json"


# What each variant's checkpoint was trained for (Wan2.1 / Wan2.2 model cards and generate configs:
# TI2V-5B 1280*704 x 121 frames at 24 fps; the A14B experts 1280*720 x 81 at 16 fps; Wan2.1 I2V
# ships a 480P and a 720P release). Applied when a directory has no mmgen_defaults.json.
WAN21_T2V_DEFAULTS = GenerationDefaults(
    chosen_by="mmgen's Wan2.1 T2V defaults (no mmgen_defaults.json, no variant mark): 480x832, 81 frames, 16 fps"
)
VARIANT_SIZES = {
    "ti2v": (704, 1280, 121, 24),
    "a14b": (720, 1280, 81, 16),
    "i2v-720p": (720, 1280, 81, 16),
    "i2v-480p": (480, 832, 81, 16),
}


def variant_generation_defaults(
    directory: Path, *, expand_timesteps: bool, two_experts: bool, image_encoder: bool
) -> GenerationDefaults:
    """The defaults of a directory without mmgen_defaults.json, from what its configs say it is.

    expand_timesteps (model_index.json): Wan2.2 TI2V-5B. boundary_ratio with transformer_2: Wan2.2
    A14B (T2V or I2V). An image_encoder: Wan2.1 I2V, whose 480P and 720P releases have identical
    configs: the only mark is the release name, so a path component naming 720P picks 720x1280 and
    anything else 480x832 (chosen_by says which and why).
    """
    if expand_timesteps:
        key, why = "ti2v", "Wan2.2 TI2V-5B (expand_timesteps in model_index.json)"
    elif two_experts:
        key, why = "a14b", "Wan2.2 A14B (two experts, boundary_ratio in model_index.json)"
    elif image_encoder:
        named = any("720p" in part.casefold() for part in Path(directory).resolve().parts)
        key = "i2v-720p" if named else "i2v-480p"
        why = (
            f"Wan2.1 I2V {'720P' if named else '480P'} (image_encoder in model_index.json; the path "
            f"{'names' if named else 'does not name'} 720P, the only mark telling the releases apart)"
        )
    else:
        return WAN21_T2V_DEFAULTS
    height, width, frames, fps = VARIANT_SIZES[key]
    return GenerationDefaults(
        height=height,
        width=width,
        num_frames=frames,
        fps=fps,
        chosen_by=f"{why}: trained at {height}x{width}, {frames} frames, {fps} fps",
    )


@dataclass(frozen=True, eq=False)
class WanComponents:
    """Everything a Wan pipeline is made of. `scheduler` is a template: pipelines copy it per call.

    The variant's parts and values: transformer_2 with boundary_ratio (Wan2.2 A14B: `transformer`
    serves t >= boundary_ratio * num_train_timesteps, `transformer_2` below), image_encoder with
    image_preprocess (Wan2.1 I2V), expand_timesteps (Wan2.2 TI2V).
    """

    transformer: WanDiT
    text_encoder: UMT5Encoder
    tokenizer: TextTokenizer
    vae: Any  # diffusers AutoencoderKLWan
    scheduler: Any  # diffusers UniPCMultistepScheduler or FlowMatchEulerDiscreteScheduler
    defaults: GenerationDefaults = WAN21_T2V_DEFAULTS
    source: Path | None = None
    transformer_2: WanDiT | None = None
    image_encoder: ClipVisionEncoder | None = None
    image_preprocess: ClipImagePreprocess | None = None
    boundary_ratio: float | None = None
    expand_timesteps: bool = False


def read_generation_defaults(
    directory: Path, *, expand_timesteps: bool = False, two_experts: bool = False, image_encoder: bool = False
) -> GenerationDefaults:
    """The directory's mmgen_defaults.json; without one, the defaults of the variant its configs mark
    (variant_generation_defaults: Wan2.1 T2V's when no mark is set)."""
    path = Path(directory) / DEFAULTS_FILE
    if not path.exists():
        return variant_generation_defaults(
            directory, expand_timesteps=expand_timesteps, two_experts=two_experts, image_encoder=image_encoder
        )
    return GenerationDefaults.from_dict(read_json(path), source=path)


def check_compatible(components: WanComponents) -> None:
    """Cross-component shape agreements a mismatched directory would otherwise break mid-generation."""
    source = components.source or Path("<components>")
    dit = components.transformer.config
    text = components.text_encoder.config
    vae = components.vae.config
    pairs = [
        ("transformer text_dim", dit.text_dim, "text_encoder d_model", text.d_model),
        ("transformer out_channels", dit.out_channels, "vae z_dim", vae.z_dim),
    ]
    if components.transformer_2 is not None:
        second = components.transformer_2.config
        for name in ("in_channels", "out_channels", "text_dim", "patch_size", "image_dim"):
            pairs.append(
                (f"transformer {name}", getattr(dit, name), f"transformer_2 {name}", getattr(second, name))
            )
    if components.image_encoder is not None:
        pairs.append(
            (
                "transformer image_dim",
                dit.image_dim,
                "image_encoder hidden_size",
                components.image_encoder.config.hidden_size,
            )
        )
    for left, left_value, right, right_value in pairs:
        if left_value != right_value:
            raise LoadError(f"{source}: {left} = {left_value} but {right} = {right_value}; they must match")
    # in_channels: the noise alone (T2V, TI2V) or noise + frame mask + image latents (I2V).
    allowed = (
        (vae.z_dim,)
        if components.expand_timesteps
        else (vae.z_dim, 2 * vae.z_dim + vae.scale_factor_temporal)
    )
    if dit.in_channels not in allowed:
        raise LoadError(
            f"{source}: transformer in_channels = {dit.in_channels}; with vae z_dim {vae.z_dim} it must be "
            f"{' or '.join(map(str, allowed))} (text-to-video{'' if components.expand_timesteps else ' or image-to-video'})"
        )
    if dit.image_dim is not None and components.image_encoder is None:
        raise LoadError(
            f"{source}: the transformer has an image path (image_dim) but there is no image_encoder"
        )
    if components.tokenizer.vocab_size > text.vocab_size:
        raise LoadError(
            f"{source}: tokenizer has {components.tokenizer.vocab_size} ids but text_encoder vocab_size is "
            f"{text.vocab_size}"
        )
    for name in ("latents_mean", "latents_std"):
        values = getattr(vae, name)
        if len(values) != vae.z_dim or not all(math.isfinite(v) for v in values):
            raise LoadError(f"{source}: vae {name} must hold {vae.z_dim} finite numbers, got {values!r}")
