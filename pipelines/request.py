"""One generation request: every option a user can set, defined once.

`GenerationRequest` is the single definition of what a generation asks for. The faces are made from
it and list no field again: the Python call (`pipe(prompt, height=..., ...)` builds one), the flags
of `mmgen generate`, a render YAML job, `mmgen ab`'s variables, the server's JSON body and the
request recorded in results and manifests. Each field states

- its type, its default (None = "the model's default", resolved when the request is prepared),
  its allowed values (checked here, once, with an error naming field, value and what is allowed);
- its role (`ROLES`): "job" fields say what to make (two runs compare only the same jobs); "run"
  fields say how to run it and leave the output equal up to rounding; "lossy" fields change the
  output on purpose and must be declared (they are recorded, fingerprinted and may be ab's variable);
- its help text, and the flag of `mmgen generate` when that differs from `--field-name`.

Validation here is model-independent (a multiple of 16, 4k+1 frames, ranges, names, files that must
exist); what depends on the loaded model (its spatial multiple and temporal stride, its defaults)
is checked when the pipeline prepares the request. A CLI typo, a bad YAML job or a bad JSON body
fails here, before any model loads.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    AliasChoices,
    ConfigDict,
    field_serializer,
    field_validator,
    model_validator,
)

from mmgen.attention.selection import BACKEND_NAMES
from mmgen.errors import ValidationError
from mmgen.lora.request import LORA_MODES, LoRARequest
from mmgen.placement.policy import DECODE_MODES, OFFLOAD_MODES, check_budget
from pipelines.checks import (
    MAX_LORAS,
    MAX_REFERENCE_IMAGES,
    MAX_SEED,
    MAX_STEPS,
    PIXELS_HELP,
    check_attention_backend,
    check_guidance,
    check_num_frames,
    check_pixels,
    check_seed,
    check_steps,
)
from pipelines.denoise import CFG_MODES
from pipelines.image_input import MAX_IMAGE_SIDE, MAX_INPUT_IMAGES, ImageInput, images_of, read_images
from pipelines.presets import FAMILIES, check_preset, preset_value, presets_of
from pipelines.request_base import RequestBase
from pipelines.request_fields import (
    MAX_PROMPT_CHARS,
    MAX_SIDE,
    MAX_TEXT_LEN,
    check_lora_files,
    check_prompt,
    check_side,
    check_text_len,
    check_vace_scale,
    field_rule,
    request_field,
)
from pipelines.step_cache import (
    ACCEL_PRESETS,
    check_accel,
    check_cfg_truncation,
    check_step_cache,
    resolve_accel,
)
from pipelines.video_input import VideoInput, read_reference_images, read_video


class GenerationRequest(RequestBase):
    """Everything one generation asks for; frozen, validated on construction (see the module docstring)."""

    # strict: "64" (a string) is not a height, 1.5 is not a frame count; forbid: a typo is an error.
    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, arbitrary_types_allowed=True, populate_by_name=True
    )

    prompt: str = request_field(
        ..., "job", f"the text prompt (at most {MAX_PROMPT_CHARS} characters)", min_length=1, recorded=True
    )
    negative_prompt: str | None = request_field(
        None,
        "job",
        f"what to steer away from (default: the model's; at most {MAX_PROMPT_CHARS} characters)",
        recorded=True,
    )
    height: int | None = request_field(
        None, "job", f"pixels, a multiple of 16, at most {MAX_SIDE}; {PIXELS_HELP}", recorded=True
    )
    width: int | None = request_field(
        None, "job", f"pixels, a multiple of 16, at most {MAX_SIDE}; {PIXELS_HELP}", recorded=True
    )
    num_frames: int | None = request_field(
        None, "job", f"frame count, 4k+1 (1 = an image); {PIXELS_HELP}", flag="--frames", recorded=True
    )
    num_inference_steps: int | None = request_field(
        None, "job", f"denoising steps, 1 to {MAX_STEPS}", flag="--steps", recorded=True
    )
    guidance_scale: float | None = request_field(
        None,
        "job",
        "classifier-free guidance scale (>= 0; CFG runs when > 1)",
        flag="--guidance",
        recorded=True,
    )
    guidance_scale_2: float | None = request_field(
        None,
        "job",
        "the low-noise expert's guidance (Wan2.2 A14B; default: guidance_scale)",
        flag="--guidance-2",
        recorded=True,
        needs=("two_experts",),
    )
    seed: int | None = request_field(
        None,
        "job",
        f"noise seed in [0, {MAX_SEED}] (= 2**63 - 1; default: a fresh random one, recorded)",
        recorded=True,
    )
    image: ImageInput | tuple[ImageInput, ...] | None = request_field(
        None,
        "job",
        "input image (PNG/JPEG/WebP; an alpha channel is kept): the conditioning image of I2V / TI2V models, "
        "the image an edit model edits; several (repeat the flag, a list in YAML / JSON; at most "
        f"{MAX_INPUT_IMAGES}) only for models that read several (Qwen-Image-2.1's condition images, in "
        f"order); each at most {MAX_IMAGE_SIDE} pixels a side; without height/width the (last) image sets "
        "the size",
        needs=("i2v", "ti2v", "edit"),
        several=("several_images",),
    )
    output_resolution: int | None = request_field(
        None,
        "job",
        "Qwen-Image-2.1 (diffusers' output_resolution): condition images are resized to about this many "
        "pixels squared (their aspect ratio kept, sides / 32), and without height/width the output is "
        f"too (default: the model's, 1024); 32 to {MAX_SIDE}",
        recorded=True,
        needs=("output_resolution",),
        ge=32,
        le=MAX_SIDE,
    )
    video: VideoInput | None = request_field(
        None,
        "job",
        "VACE control video: a video file, an image, or a folder of frames (or a uint8 [T, H, W, 3] array); "
        "exactly num_frames frames of height x width",
        needs=("vace",),
    )
    mask: VideoInput | None = request_field(
        None,
        "job",
        "VACE mask, per pixel per frame (white = generate, black = keep the video's pixels); "
        "as video, num_frames frames of height x width (default: generate everything)",
        needs=("vace",),
    )
    reference_images: tuple[ImageInput, ...] = request_field(
        (),
        "job",
        f"VACE reference image(s) (PNG/JPEG/WebP; repeat the flag for several, at most {MAX_REFERENCE_IMAGES}), "
        "each fitted on a white canvas",
        flag="--reference-image",
        needs=("vace",),
    )
    vace_scale: float | tuple[float, ...] = request_field(
        1.0,
        "job",
        "VACE control strength: one scale for every control hint, or one per VACE block in block order "
        "(a list; on the command line comma-separated, e.g. 1,0.8,0.6,...)",
        needs=("vace",),
    )
    # off, the same keys and values are computed again at every step: equal up to summation order
    no_prefix_cache: bool = request_field(
        False,
        "run",
        "recompute the prompt's and condition images' keys and values at every step instead of keeping "
        "them from the first (Qwen-Image-2.1's block-causal prefix, modulated at t = 0, is cached by "
        "default: later steps compute only the target image); the same image up to rounding, slower",
        recorded=True,
        fingerprint=(),
        needs=("prefix_cache",),
    )
    max_sequence_length: int | None = request_field(
        None,
        "job",
        f"text tokens the prompt is padded to, 2 to {MAX_TEXT_LEN} (default: the model's)",
        recorded=True,
    )
    attention_backend: str = request_field(
        "auto",
        "run",
        f"attention: {', '.join(BACKEND_NAMES)}",
        flag="--backend",
        recorded=True,
        fingerprint=("attention_providers", "attention_providers.*"),
    )
    # placement, chunking, decode split and compiled blocks change where and in what pieces work
    # runs, not the environment: no fingerprint field (fingerprint=())
    compile: bool = request_field(
        False,
        "run",
        "torch.compile the DiT blocks (first step slower)",
        recorded=True,
        fingerprint=(),
        needs=("compile",),
    )
    offload: Literal[OFFLOAD_MODES] | None = request_field(
        None,
        "run",
        "weights on the GPU only while they run: model (whole components), layer (layers streamed from "
        "pinned host memory); default none, or planned by gpu_memory_gb",
        fingerprint=(),
    )
    gpu_memory_gb: float | None = request_field(
        None,
        "run",
        "GPU memory budget in GiB: the least offloading that fits (an error if nothing does)",
        fingerprint=(),
        needs=("memory_planner",),
    )
    cfg: Literal[CFG_MODES] | None = request_field(
        None,
        "run",
        "guided steps as one batch-2 call or two batch-1 calls (less memory)",
        fingerprint=(),
    )
    ffn_chunk: int | None = request_field(
        None,
        "run",
        "tokens per FFN chunk (less activation memory)",
        ge=1,
        fingerprint=(),
        needs=("ffn_chunk",),
    )
    block_chunk: int | None = request_field(
        None,
        "run",
        "tokens per chunk of each block's per-token work",
        ge=1,
        fingerprint=(),
        needs=("block_chunk",),
    )
    decode: Literal[DECODE_MODES] | None = request_field(
        None,
        "run",
        "VAE decode: full, frames, bands2/4/8 (exact up to conv rounding; spread over the GPUs, the same "
        "bits on any number), tiled (lossy), split (several GPUs: a band per rank, exact in values, not bits)",
        fingerprint=(),
        needs=("split_decode",),
        off=("full",),
    )
    # LoRAs: the fingerprint's "loras" identity (sha256, strength, experts, mode) may change
    lora: tuple[LoRARequest, ...] = request_field(
        (),
        "lossy",
        f"LoRA(s), at most {MAX_LORAS}: PATH[:STRENGTH][@EXPERT] or {{path, strength, experts}}; @0/@1 picks "
        "a Wan2.2 expert",
        validation_alias=AliasChoices("lora", "loras"),
        fingerprint=("loras", "loras.*"),
    )
    lora_mode: Literal[LORA_MODES] = request_field(
        "fused",
        "run",
        "fused (merged into the weights) or unfused (low-rank matmuls beside them)",
        fingerprint=("loras.mode",),
    )
    lora_allow_unmatched: bool = request_field(
        False,
        "run",
        "apply LoRAs even if some of their keys match no weight (listed in the report)",
        fingerprint=("loras", "loras.*"),
    )
    # a preset fixes steps, guidance and the scheduler, and the lossy accelerations change the numbers:
    # neither moves the environment; FP8 attention (also an accel preset's, where native) names its
    # kernel in the attention providers ('flash:fa3 e4m3')
    preset: str | None = request_field(
        None,
        "lossy",
        "named settings of one model family (fix steps, guidance and the scheduler): "
        + "; ".join(f"{', '.join(presets_of(family))} ({label})" for family, label in FAMILIES.items()),
        recorded=True,
        fingerprint=(),
    )
    step_cache: float | None = request_field(
        None,
        "lossy",
        "reuse a step's DiT outputs while the accumulated timestep-signal change stays below this "
        "threshold (0 = exact); off by default",
        fingerprint=(),
        lossy_args=("step_cache", "step_cache_reused"),
        needs=("step_cache",),
    )
    cfg_truncation: float | None = request_field(
        None,
        "lossy",
        "keep CFG for this fraction (0, 1] of the steps, then the conditional branch only",
        fingerprint=(),
        lossy_args=("cfg_truncation",),
        needs=("cfg_truncation",),
    )
    accel: str | None = request_field(
        None,
        "lossy",
        f"lossy speed-up presets named by cost: {', '.join(ACCEL_PRESETS)} (step caching + CFG "
        "truncation, FP8 where native)",
        fingerprint=("attention_providers", "attention_providers.*"),
        lossy_args=("accel", "accel_skipped"),
        needs=("accel",),
    )
    fp8_linear: bool | None = request_field(
        None,
        "lossy",
        "the DiT's linear layers in FP8 e4m3 where it pays (Ada/Hopper, bf16; emulated elsewhere)",
        fingerprint=(),
        lossy_args=("fp8_linear", "fp8_linear_layers"),
        needs=("fp8_linear",),
        off=(False,),
    )
    fp8_attention: bool | None = request_field(
        None,
        "lossy",
        "self-attention on FP8 e4m3 q/k/v through FA3's FP8 forward (emulated elsewhere)",
        fingerprint=("attention_providers", "attention_providers.*"),
        lossy_args=("fp8_attention",),
        needs=("fp8_attention",),
        off=(False,),
    )

    # -- checks: the rules the runtime states once (pipelines.checks, presets, step_cache, ...) --

    _prompt = field_validator("prompt", "negative_prompt")(field_rule(check_prompt))
    _height = field_validator("height", "width")(field_rule(lambda value, name: check_side(name, value)))
    _frames = field_validator("num_frames")(field_rule(lambda value, name: check_num_frames(value)))
    _steps = field_validator("num_inference_steps")(field_rule(lambda value, name: check_steps(value)))
    _guidance = field_validator("guidance_scale", "guidance_scale_2", mode="before")(
        field_rule(lambda value, name: check_guidance(value, name), keep=False)
    )
    _seed = field_validator("seed")(field_rule(lambda value, name: check_seed(value)))
    _text_len = field_validator("max_sequence_length")(field_rule(lambda value, name: check_text_len(value)))
    _backend = field_validator("attention_backend")(
        field_rule(lambda value, name: check_attention_backend(value))
    )
    _budget = field_validator("gpu_memory_gb", mode="before")(
        field_rule(lambda value, name: check_budget(value), keep=False)
    )
    _step_cache = field_validator("step_cache", mode="before")(
        field_rule(lambda value, name: check_step_cache(value), keep=False)
    )
    _cfg_truncation = field_validator("cfg_truncation", mode="before")(
        field_rule(lambda value, name: check_cfg_truncation(value), keep=False)
    )
    _preset = field_validator("preset")(field_rule(lambda value, name: check_preset(value)))
    _accel = field_validator("accel")(field_rule(lambda value, name: check_accel(value)))
    # A path (the JSON faces) or a uint8 array (the Python call): read and hashed once, here.
    _image = field_validator("image", mode="before")(
        field_rule(lambda value, name: read_images(value, field=name), keep=False)
    )
    _video = field_validator("video", "mask", mode="before")(
        field_rule(
            lambda value, name, bound: read_video(value, field=name, max_pixels=bound),
            keep=False,
            bounded=True,
        )
    )
    _references = field_validator("reference_images", mode="before")(
        field_rule(lambda value, name: read_reference_images(value, field=name), keep=False)
    )
    _vace_scale = field_validator("vace_scale", mode="before")(
        field_rule(lambda value, name: check_vace_scale(value), keep=False)
    )
    _lora = field_validator("lora", mode="before")(
        field_rule(lambda value, name: check_lora_files(value), keep=False)
    )

    @model_validator(mode="after")
    def _consistent(self) -> GenerationRequest:
        """The pixel bounds; what a preset or accel preset fixes may not be given another value."""
        try:
            check_pixels(self.height, self.width, self.num_frames)
            preset = check_preset(self.preset)
            for name in ("num_inference_steps", "guidance_scale"):
                preset_value(preset, name, getattr(self, name))
            resolve_accel(
                self.accel, self.step_cache, self.cfg_truncation, self.fp8_linear, self.fp8_attention
            )
        except ValidationError as err:
            raise ValueError(str(err)) from None
        return self

    @property
    def images(self) -> tuple[ImageInput, ...]:
        """The input images in order: () without `image`, one, or several."""
        return images_of(self.image)

    @field_serializer("image")
    def _image_json(self, image: ImageInput | tuple[ImageInput, ...] | None) -> str | list[str] | None:
        if isinstance(image, tuple):
            return [item.source for item in image]
        return None if image is None else image.source

    @field_serializer("video", "mask")
    def _video_json(self, video: VideoInput | None) -> str | None:
        return None if video is None else video.source

    @field_serializer("reference_images")
    def _references_json(self, images: tuple[ImageInput, ...]) -> list[str]:
        return [image.source for image in images]

    @field_serializer("lora")
    def _lora_json(self, lora: tuple[LoRARequest, ...]) -> list[dict[str, Any]]:
        return [request.to_json() for request in lora]

    def record(self) -> dict[str, Any]:
        """The request as JSON-ready values, every field (what a result or manifest records)."""
        data = self.model_dump()
        if self.image is not None:
            data["image_sha256"] = (
                [i.sha256 for i in self.images] if len(self.images) > 1 else self.image.sha256
            )
        for name in ("video", "mask"):
            if getattr(self, name) is not None:
                data[f"{name}_sha256"] = getattr(self, name).sha256
        if self.reference_images:
            data["reference_images_sha256"] = [image.sha256 for image in self.reference_images]
        return data


__all__ = ("GenerationRequest",)
