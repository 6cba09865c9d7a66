"""Qwen-Image text-to-image: GenerationRequest -> plan -> denoise (one packed true-CFG call per step) -> image.

Numerically this is diffusers' QwenImagePipeline: the same prompt template and prefix drop, seeded
CPU noise of the same shape, dtype and 2x2 packing (a seed reproduces a diffusers image), the same
FlowMatch Euler schedule (sigmas linspace(1, 1/steps), dynamic shift mu from the image token count),
the same norm-preserving true CFG, latent denormalization and uint8 conversion. It differs in how
the work runs: the conditional and unconditional prompts (each its own length) go through the
transformer as ONE call of batch 2 whose joint attention is varlen over each sample's own
[text_b, image] tokens (mmgen.models.qwen_image_joint), where diffusers makes two calls per step.

`guidance_scale` is Qwen-Image's true CFG scale (diffusers' `true_cfg_scale`): CFG runs when it is
> 1 and a negative prompt is given (even " "), as in diffusers; otherwise one prompt, batch 1.

A call is one GenerationRequest (pipelines.request) made into work in three steps (DESIGN.md "One
request value"), as `generate(request)` runs them; they are methods here, small and in this file:
`prepare` (request -> a frozen QwenImagePlan: refusals, defaults filled, attention impl, schedule
inputs, noise), `run` (text encode, denoise, decode), `record` (the GenerationResult). The Python
call `pipe(prompt, ...)` builds the request and calls `generate`; every face hands over its request.

Presets of the Qwen-Image family (pipelines.presets: `lightning-8step`, `lightning-4step`, the
Qwen-Image-Lightning LoRAs' schedule) replace the checkpoint's scheduler config for the call.

Qwen-Image-Edit (pipelines.qwen_image_edit) is this pipeline with a conditioning image: the class
there fills in the steps marked as hooks here (`_variant_refusals`, `_variant_defaults`,
`_condition_size`, `encode_text`, `encode_condition`, `_variant_args`); the loop, schedule, CFG,
decode and record are these ones. In the loop a condition's packed latents ride after the noise tokens (plan.grids: the
noise grid, then the image's) and the prediction is cut back to the noise tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmgen.attention import select_attention
from mmgen.attention.impls import AttentionImpl
from mmgen.errors import LoadError, ValidationError
from mmgen.fingerprint import environment_fingerprint
from mmgen.loading.qwen_image_dir import (
    PIPELINE_CLASS,
    QwenImageComponents,
    load_qwen_image_components,
    qwen_pipeline_class,
)
from mmgen.loading.qwen_tokenizer import QwenTokenizer
from mmgen.lora import LoRASlot, read_lora_file
from mmgen.lora.qwen_image import parse_qwen_image_lora
from mmgen.lora.report import LoRAReport
from mmgen.models.qwen_image import QwenImageTransformer, true_cfg_combine
from mmgen.models.qwen_image_joint import JointTokens
from mmgen.models.qwen_image_prompt import MAX_TEXT_TOKENS, templated_prompts
from mmgen.models.qwen_image_text import QwenTextEncoder, QwenVisionTextEncoder
from mmgen.models.settings import ExecutionSettings
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from mmgen.parallel.layout import ParallelLayout
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.peaks import StagePeaks
from mmgen.placement.policy import MemoryPlan, check_offload
from mmgen.placement.tensors import PinnedStore
from mmgen.progress import ProgressReporter, as_reporter
from pipelines.capabilities import Capabilities
from pipelines.common import GenerationResult, video_to_uint8
from pipelines.devices import check_device, check_dtype, synchronize
from pipelines.presets import Preset, check_family, preset_value
from pipelines.request import GenerationRequest

FAMILY = "qwen-image"  # pipelines.presets: the presets this pipeline takes


@dataclass(frozen=True)
class QwenImageDefaults:
    """The values of request fields a call leaves out: diffusers' QwenImagePipeline.__call__ defaults
    (default_sample_size 128 x VAE scale 8 = 1024 pixels). fps: what an image records (a png has none)."""

    height: int = 1024
    width: int = 1024
    num_frames: int = 1
    num_inference_steps: int = 50
    guidance_scale: float = 4.0
    max_sequence_length: int = 512
    fps: int = 1
    chosen_by: str = "diffusers' QwenImagePipeline defaults"

    def request_values(self) -> dict[str, Any]:
        """The defaults by request field name (fps and chosen_by are not request fields)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name not in ("fps", "chosen_by")
        }


DEFAULTS = QwenImageDefaults()
ATTENTION_SITES = ("transformer.joint_attn",)
# What a Qwen-Image model does: the request fields that apply follow from it (pipelines.capabilities).
CAPABILITIES = Capabilities(
    "image",
    ("t2i",),
    notes=(
        (
            "edit",
            "this directory is Qwen-Image, text-to-image; an image to edit needs a Qwen-Image-Edit directory",
        ),
    ),
)


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The schedule's dynamic shift mu for an image of image_seq_len tokens (diffusers' calculate_shift)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, 1, h, w] (or diffusers' noise [B, 1, C, h, w]) -> [B, (h/2) * (w/2), 4C]: 2x2 patches in
    diffusers' order."""
    batch, height, width = latents.shape[0], latents.shape[-2], latents.shape[-1]
    flat = latents.reshape(batch, -1, height, width)  # the frame axis is 1 on either side of C
    channels = flat.shape[1]
    patches = flat.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, (height // 2) * (width // 2), channels * 4)


def draw_noise(
    generator: torch.Generator, channels: int, height: int, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """diffusers' initial latents: standard normal [1, 1, channels, height, width] (the latent grid) in
    `dtype` (its text encoder's) from a CPU generator, packed -> [1, N, 4 * channels] on the CPU."""
    return pack_latents(torch.randn((1, 1, channels, height, width), generator=generator, dtype=dtype))


def unpack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, N, 4C] for a latent grid height x width (the pixels / 8) -> [B, C, 1, height, width]."""
    batch, _, channels = latents.shape
    grid = latents.view(batch, height // 2, width // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(batch, channels // 4, 1, height, width)


@dataclass(frozen=True)
class QwenImagePlan:
    """Everything one call decided before any model runs.

    request: the call's GenerationRequest with the model's defaults filled in; guided: true CFG runs
    (two prompts: one packed call per step under cfg 'batch', two under 'sequential'); noise: the
    packed initial latents [1, N, 4C] in the model dtype on the device; grid: the latent (frames,
    rows, cols) token grid; sigmas / mu: the schedule inputs; scheduler_config: the FlowMatch Euler
    config they run on (the checkpoint's, or the preset's); memory: the memory plan (the pipeline's
    offload, chosen at load; cfg batch or sequential; full decode).
    """

    request: GenerationRequest
    guided: bool
    attention: AttentionImpl
    noise: torch.Tensor
    noise_source: str
    grid: tuple[int, int, int]
    sigmas: tuple[float, ...]
    mu: float
    scheduler_config: Mapping[str, Any]
    preset: Preset | None = None
    memory: MemoryPlan = MemoryPlan()
    # Edit: the input image's (height, width) as it is encoded, and its token grid (RoPE frame index 1).
    condition_size: tuple[int, int] | None = None
    condition_grid: tuple[int, int, int] | None = None

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        """The token grids the transformer sees, in token order: the noise, then a condition's."""
        condition = self.condition_grid
        return (self.grid,) if condition is None else (self.grid, condition)

    @property
    def prompts(self) -> list[str]:
        request = self.request
        return [request.prompt, request.negative_prompt] if self.guided else [request.prompt]

    @property
    def warnings(self) -> tuple[str, ...]:
        """What the request asks for that this plan does not do (recorded in result.args, shown by the faces)."""
        request = self.request
        if request.guidance_scale > 1 and request.negative_prompt is None:  # diffusers warns too
            return (
                f"guidance_scale = {request.guidance_scale:g} is not applied: true CFG needs a negative "
                'prompt (even " "); without one the image is made unguided',
            )
        return ()


class QwenImagePipeline:
    """Qwen-Image T2I: `pipe(prompt, negative_prompt=None, **request fields)` or `pipe.generate(request)`
    returns a GenerationResult."""

    directory_class = PIPELINE_CLASS  # the model_index.json _class_name from_pretrained loads
    title = "Qwen-Image"  # how refusals name the pipeline
    variant = "t2i"
    capabilities = CAPABILITIES

    def __init__(
        self,
        transformer: QwenImageTransformer,
        text_encoder: QwenTextEncoder | QwenVisionTextEncoder,
        tokenizer: QwenTokenizer,
        vae: Any,
        scheduler: Any,
        *,
        source: Path | None = None,
        device: str | torch.device | None = None,
        offload: str | None = None,
        host: PinnedStore | None = None,
        image_processor: Any = None,
    ) -> None:
        self.components = QwenImageComponents(
            transformer, text_encoder, tokenizer, vae, scheduler, source, image_processor
        )
        self.layout = ParallelLayout.single()  # one process: it owns its outputs
        # The LoRAs on the transformer now: each call states its own; an unchanged set stays applied.
        self.loras = LoRASlot(reader=functools.partial(read_lora_file, parse=parse_qwen_image_lora))
        self._device = transformer.img_in.weight.device if device is None else torch.device(device)
        # Where the weights live, chosen once here (mmgen.placement): 'none' all on the device; 'model'
        # each component copied in while it runs; 'layer' the transformer's blocks streamed as well.
        self.offload = check_offload("none" if offload is None else offload)
        self.placement = OffloadPlacement(
            self.offload,
            experts=(transformer,),
            text_encoder=text_encoder.module,
            vae=vae,
            device=self._device,
            host=host,  # the buffers the weights were loaded into: adopted, then the store is closed
        )
        latent_channels = transformer.config.in_channels // 4
        if (
            latent_channels != vae.config.z_dim
            or transformer.config.joint_attention_dim != text_encoder.hidden_size
        ):
            raise ValidationError(
                f"components do not fit: transformer in_channels {transformer.config.in_channels} (4 x the VAE's "
                f"z_dim {vae.config.z_dim}?), joint_attention_dim {transformer.config.joint_attention_dim} "
                f"(the text encoder's hidden size {text_encoder.hidden_size}?)"
            )

    @classmethod
    def from_pretrained(
        cls,
        directory: Path | str,
        *,
        dtype: torch.dtype | str | None = None,
        device: str | torch.device = "cpu",
        vae_dtype: torch.dtype | str = torch.float32,
        torch_dtype: torch.dtype | str | None = None,
        offload: str | None = None,
    ) -> QwenImagePipeline:
        """Load a local diffusers-format Qwen-Image directory (mmgen.loading.qwen_image_dir); transformer
        and text encoder in `dtype` (default float32), the VAE in `vae_dtype`. To reproduce a diffusers
        image loaded with torch_dtype=bfloat16, load with dtype and vae_dtype bfloat16.
        offload: 'none' (default), 'model' or 'layer' (the weights load into host memory and stay there,
        copied to `device` while they run; 'layer' streams the transformer's blocks: the 20B model in
        bf16 runs on a 24 GB GPU)."""
        dtype, vae_dtype = check_dtype(dtype, torch_dtype=torch_dtype), check_dtype(vae_dtype)
        device = check_device(device)
        offload = "none" if offload is None else check_offload(offload)
        found = qwen_pipeline_class(directory)
        if found is not None and found != cls.directory_class:
            raise LoadError(
                f"{directory}: model_index.json names {found}; {cls.__name__} loads {cls.directory_class} "
                "directories (pipelines.loader.load_pipeline picks the class from the directory)"
            )
        # Weights bound for offload are read straight into page-locked buffers (pinned when the device
        # is a GPU) that the placement adopts.
        host = None if offload == "none" else PinnedStore(register=torch.device(device).type == "cuda")
        c = load_qwen_image_components(
            directory, dtype=dtype, device=device if host is None else "cpu", vae_dtype=vae_dtype, host=host
        )
        return cls(
            c.transformer,
            c.text_encoder,
            c.tokenizer,
            c.vae,
            c.scheduler,
            source=c.source,
            device=device,
            offload=offload,
            host=host,
            image_processor=c.image_processor,
        )

    @property
    def transformer(self) -> QwenImageTransformer:
        return self.components.transformer

    @property
    def vae(self) -> Any:
        return self.components.vae

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def defaults(self) -> QwenImageDefaults:
        """The values a request leaves out (the server maps `size` and checks bounds with them)."""
        return DEFAULTS

    @property
    def makes_video(self) -> bool:
        """False: Qwen-Image makes one image per call (the server answers /v1/videos with a 400)."""
        return self.capabilities.outputs == "video"

    @property
    def edits_images(self) -> bool:
        """Whether the model edits an input image (the server's /v1/images/edits needs it): Edit's only."""
        return self.capabilities.has("edit")

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def vae_scale(self) -> int:
        """Pixels per latent along a side: 2 ** (the VAE's temporal-downsample entries), 8 for Qwen-Image."""
        return 2 ** len(self.vae.config.temperal_downsample)

    @property
    def spatial_multiple(self) -> int:
        """Heights and widths must be multiples of this: 16 and VAE scale x patch size."""
        return math.lcm(16, self.vae_scale * self.transformer.config.patch_size)

    @torch.no_grad()
    def __call__(
        self,
        prompt: str,
        negative_prompt: str | None = None,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        progress: bool | ProgressReporter = True,
        **fields: Any,
    ) -> GenerationResult:
        """Generate one image: result.frames uint8 [1, H, W, 3]. `fields` are GenerationRequest's (height,
        width, num_inference_steps, guidance_scale, seed, max_sequence_length, attention_backend, lora,
        preset, ...); left out, the model's defaults (DEFAULTS, diffusers'). The call builds the one
        request value, then `generate` runs it. Noise: `latents` (packed [1, N, 4C] as diffusers takes
        them, or [1, C, 1, H/8, W/8] as result.latents holds them), else drawn on the CPU from
        `generator`, else from `seed` (a fresh random one when absent, recorded). `progress`: True
        (tqdm), False or a reporter."""
        request = GenerationRequest.from_pipeline_call(prompt, negative_prompt, **fields)
        return self.generate(request, generator=generator, latents=latents, progress=progress)

    @torch.no_grad()
    def generate(
        self,
        request: GenerationRequest,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
        progress: bool | ProgressReporter = True,
    ) -> GenerationResult:
        """The request, in three steps: prepare (the frozen plan; every refusal before any work), run,
        record. A field this pipeline cannot honour is an error naming it (one line each)."""
        started = time.perf_counter()
        plan = self.prepare(request, generator=generator, latents=latents)
        # Before any work: read, check and apply (or keep) the LoRAs; errors leave the base weights.
        loras = self.loras.use(
            (self.transformer,),
            plan.request.lora,
            mode=plan.request.lora_mode,
            allow_unmatched=plan.request.lora_allow_unmatched,
        )
        reporter, owned = as_reporter(progress)
        try:
            final, frames, timings, memory = self.run(plan, reporter)
        finally:
            if owned:
                reporter.close()
        timings["total"] = time.perf_counter() - started
        return self.record(plan, final, frames, timings, memory, loras)

    # -- prepare --

    def prepare(
        self,
        request: GenerationRequest,
        *,
        generator: torch.Generator | None = None,
        latents: torch.Tensor | None = None,
    ) -> QwenImagePlan:
        """The plan of `request`: refusals first (one line per field), then defaults, noise and schedule."""
        if request.seed is not None and generator is not None:
            raise ValidationError("pass either seed or generator, not both")
        if generator is not None and (
            not isinstance(generator, torch.Generator) or generator.device.type != "cpu"
        ):
            raise ValidationError("generator must be a CPU torch.Generator (noise is drawn on the CPU)")
        request, preset = self._resolve(request, seeded=generator is None and latents is None)
        rows, cols = request.height // self.vae_scale // 2, request.width // self.vae_scale // 2
        config = self._scheduler_config(preset)
        steps = request.num_inference_steps
        # diffusers' sigmas for `steps` (a preset's are the same rule), mu from the config in use
        sigmas = preset.sigmas if preset is not None else tuple(np.linspace(1.0, 1 / steps, steps).tolist())
        mu = calculate_shift(
            rows * cols,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        noise, source = self._initial_latents(request, generator, latents)
        condition_size = self._condition_size(request)
        condition_grid = None
        if condition_size is not None:
            pixels_per_token = self.vae_scale * self.transformer.config.patch_size
            condition_grid = (1, condition_size[0] // pixels_per_token, condition_size[1] // pixels_per_token)
        return QwenImagePlan(
            request=request,
            guided=request.guidance_scale > 1 and request.negative_prompt is not None,
            attention=select_attention(
                request.attention_backend,
                device=self.device,
                dtype=self.dtype,
                head_dim=self.transformer.config.attention_head_dim,
            ),
            noise=noise,
            noise_source=source,
            grid=(1, rows, cols),
            sigmas=sigmas,
            mu=mu,
            scheduler_config=config,
            preset=preset,
            memory=MemoryPlan(offload=self.offload, cfg=request.cfg or "batch"),
            condition_size=condition_size,
            condition_grid=condition_grid,
        )

    def check_request(self, request: GenerationRequest) -> GenerationRequest:
        """What `generate` would refuse in `request`, raised without running or drawing anything (the
        server checks a request with it before queueing the job); returns the request with this
        model's defaults filled in (no seed drawn)."""
        return self._resolve(request, seeded=False)[0]

    def _resolve(
        self, request: GenerationRequest, *, seeded: bool
    ) -> tuple[GenerationRequest, Preset | None]:
        """The request with this model's defaults filled in (a fresh seed when `seeded` and none is
        given) and its preset, after every refusal (one line per field)."""
        refused = self.capabilities.refusals(request, self.title)
        refused += self._variant_refusals(request)
        if request.offload not in (None, self.offload):
            refused.append(
                f"offload = {request.offload!r}: this pipeline was loaded with offload {self.offload!r} "
                "(chosen at load: from_pretrained(offload=...), `mmgen generate --offload`)"
            )
        if request.lora and self.offload != "none" and request.lora_mode != "fused":
            # Fused deltas go into the weights wherever they live (the host copies when offloaded);
            # unfused low-rank pairs would be new tensors the placement does not move.
            refused.append(
                f"lora_mode = {request.lora_mode!r}: with offload {self.offload!r} only 'fused' LoRAs run"
            )
        if request.num_frames not in (None, 1):
            refused.append(f"num_frames = {request.num_frames}: Qwen-Image makes one image (1 frame)")
        if refused:
            raise ValidationError("; ".join(refused))
        preset = check_family(request.preset, FAMILY)  # a Wan preset: one line naming this family's
        defaults = {**DEFAULTS.request_values(), **self._variant_defaults(request)}
        filled = {name: value for name, value in defaults.items() if getattr(request, name) is None}
        for name in ("num_inference_steps", "guidance_scale"):  # the preset's, when it fixes them
            value = preset_value(preset, name, getattr(request, name))
            if value is not None and getattr(request, name) is None:
                filled[name] = value
        if request.seed is None and seeded:
            filled["seed"] = secrets.randbits(63)
        request = request.with_values(**filled) if filled else request
        self._check_size(request)
        if request.max_sequence_length > MAX_TEXT_TOKENS:
            raise ValidationError(
                f"max_sequence_length = {request.max_sequence_length}: at most {MAX_TEXT_TOKENS} for Qwen-Image"
            )
        config = self._scheduler_config(preset)
        if request.num_inference_steps == 1 and config.get("shift_terminal"):
            raise ValidationError(
                f"num_inference_steps = 1: the scheduler's shift_terminal ({config['shift_terminal']}) "
                "stretches a one-step schedule to a NaN sigma (diffusers' too); use 2 or more"
            )
        return request, preset

    def _variant_refusals(self, request: GenerationRequest) -> list[str]:
        """Hook: what this variant refuses beyond its capabilities (T2I: nothing more)."""
        return []

    def _variant_defaults(self, request: GenerationRequest) -> dict[str, Any]:
        """Hook: request values this variant defaults differently from DEFAULTS (T2I: none)."""
        return {}

    def _condition_size(self, request: GenerationRequest) -> tuple[int, int] | None:
        """Hook: the conditioning image's (height, width) as encoded (T2I: no condition)."""
        return None

    def _variant_args(self, plan: QwenImagePlan) -> dict[str, Any]:
        """Hook: what this variant adds to (or states differently in) the recorded args (T2I: nothing)."""
        return {}

    def _scheduler_config(self, preset: Preset | None) -> Mapping[str, Any]:
        """The FlowMatch Euler config a call runs on: the preset's, else the checkpoint's."""
        return preset.scheduler_config if preset is not None else self.components.scheduler.config

    def _check_size(self, request: GenerationRequest) -> None:
        multiple = self.spatial_multiple
        for name in ("height", "width"):
            if getattr(request, name) % multiple:
                raise ValidationError(f"{name} = {getattr(request, name)}: must be a multiple of {multiple}")

    def _initial_latents(
        self, request: GenerationRequest, generator: torch.Generator | None, latents: torch.Tensor | None
    ) -> tuple[torch.Tensor, str]:
        """Packed [1, N, 4C] in the model dtype on the device, and where it came from. Drawn as diffusers
        draws it: standard normal [1, 1, C, h, w] in the model dtype from a CPU generator, then packed."""
        channels = self.transformer.config.in_channels // 4
        height, width = request.height // self.vae_scale, request.width // self.vae_scale
        packed = (1, (height // 2) * (width // 2), channels * 4)
        if latents is not None:
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) not in (
                packed,
                (1, channels, 1, height, width),
            ):
                got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
                raise ValidationError(
                    f"latents: expected {packed} (packed) or {(1, channels, 1, height, width)} for this request, got {got}"
                )
            latents = latents if latents.dim() == 3 else pack_latents(latents)
            return latents.to(device=self.device, dtype=self.dtype), "latents"
        source = "seed" if generator is None else "generator"
        if generator is None:
            generator = torch.Generator("cpu").manual_seed(request.seed)
        return draw_noise(generator, channels, height, width, self.dtype).to(self.device), source

    # -- run --

    def run(
        self, plan: QwenImagePlan, reporter: ProgressReporter
    ) -> tuple[torch.Tensor, np.ndarray, dict[str, float], dict[str, float]]:
        """Text encode, denoise and decode -> (final packed latents [1, N, 4C], uint8 frames [1, H, W, 3],
        timings in seconds, peak GPU memory per stage in GiB)."""
        peaks = StagePeaks(self.device)
        timings: dict[str, float] = {}
        tick = time.perf_counter()
        placement = self.placement
        with peaks.stage("text_encode"), placement.using("text_encoder"):
            text, text_lens = self.encode_text(plan)
        timings["text_encode"] = self._elapsed(tick)
        condition = None
        if plan.condition_size is not None:
            tick = time.perf_counter()
            with peaks.stage("image_encode"), placement.using("vae"):
                condition = self.encode_condition(plan)
            timings["image_encode"] = self._elapsed(tick)
        tick = time.perf_counter()
        with peaks.stage("denoise"), placement.using("expert0"):
            final = self.denoise(plan, text, text_lens, reporter, condition=condition)
        placement.park_all()  # layer offload: the stream's slots go before the decode
        timings["denoise"] = self._elapsed(tick)
        tick = time.perf_counter()
        reporter.stage("decode", 1)
        with peaks.stage("decode"), placement.using("vae"):
            frames = self.decode(final, plan.request.height, plan.request.width)
        reporter.advance()
        timings["decode"] = self._elapsed(tick)
        return final, frames, timings, dict(peaks.gib)

    def encode_text(self, plan: QwenImagePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook: the plan's prompts -> (text [B, L, D], text_lens [B]) (T2I: encode_prompts)."""
        return self.encode_prompts(plan.prompts, plan.request.max_sequence_length)

    def encode_condition(self, plan: QwenImagePlan) -> torch.Tensor | None:
        """Hook: the conditioning image's packed latents [1, M, 4C] (model dtype, device), called when
        plan.condition_size is set; T2I has no conditioning image (None)."""
        return None

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts -> (text [B, L, joint_attention_dim] in the encoder's dtype on the device, zero-padded;
        text_lens int64 [B] on the CPU), each prompt encoded alone in the chat template."""
        encoder = self.components.text_encoder
        limit = MAX_TEXT_TOKENS + encoder.prefix_tokens  # diffusers' tokenizer max_length
        ids = [
            self.components.tokenizer.encode(text, max_length=limit) for text in templated_prompts(prompts)
        ]
        text, text_lens = encoder.encode(ids, max_tokens=max_tokens)
        return text.to(self.device), text_lens

    @torch.no_grad()
    def denoise(
        self,
        plan: QwenImagePlan,
        text: torch.Tensor,
        text_lens: torch.Tensor,
        reporter: ProgressReporter,
        *,
        condition: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The FlowMatch Euler loop from plan.noise -> final packed latents [1, N, 4C] (model dtype).

        Guided, cfg 'batch': one transformer call of batch 2 per step (cond, uncond, each its own text
        length); cfg 'sequential': two calls of batch 1 (diffusers' way, less memory). The branches'
        text and JointTokens are built once here; true_cfg_combine joins the two predictions.
        condition: packed image latents [1, M, 4C] (Edit) put after the noise tokens in every call
        (plan.grids says where); the prediction keeps the N noise tokens only."""
        if plan.preset is not None:
            scheduler = plan.preset.scheduler(self.device, mu=plan.mu)
        else:
            scheduler = type(self.components.scheduler).from_config(dict(plan.scheduler_config))
            scheduler.set_timesteps(sigmas=list(plan.sigmas), device=self.device, mu=plan.mu)
        scheduler.set_begin_index(0)
        latents = plan.noise
        noise_tokens = latents.shape[1]
        extra = 0 if condition is None else condition.shape[1]
        branches = self._branches(
            text, text_lens, noise_tokens + extra, sequential=plan.memory.cfg == "sequential"
        )
        scale = plan.request.guidance_scale
        settings = ExecutionSettings(block_stream=self.placement.stream)
        reporter.stage("denoise", len(scheduler.timesteps))
        for t in scheduler.timesteps:
            timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
            tokens = latents if condition is None else torch.cat([latents, condition], dim=1)
            outputs = [
                self.transformer(
                    tokens.expand(branch.shape[0], -1, -1),
                    timestep.expand(branch.shape[0]),
                    branch,
                    grids=plan.grids,
                    attention=plan.attention,
                    metadata=joint,
                    settings=settings,
                )[:, :noise_tokens]
                for branch, joint in branches
            ]
            prediction = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
            if plan.guided:
                prediction = true_cfg_combine(prediction[:1], prediction[1:], scale)
            latents = scheduler.step(prediction, t, latents, return_dict=False)[0]
            reporter.advance()
        return latents

    def _branches(
        self, text: torch.Tensor, text_lens: torch.Tensor, image_tokens: int, *, sequential: bool
    ) -> list[tuple[torch.Tensor, JointTokens]]:
        """(text [b, L, D], its JointTokens) per transformer call of a step: all prompts in one call, or
        (sequential) each prompt alone, cut to its own length (no padding at all)."""
        if sequential:
            rows = [text[index : index + 1, : int(length)] for index, length in enumerate(text_lens)]
            lens = [[int(length)] for length in text_lens]
        else:
            rows, lens = [text], [text_lens]
        return [
            (row, JointTokens.build(row_lens, image_tokens, text_width=row.shape[1], device=self.device))
            for row, row_lens in zip(rows, lens, strict=True)
        ]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Packed final latents [1, N, 4C] -> uint8 frames [1, height, width, 3], as diffusers decodes."""
        vae = self.vae
        device = next(vae.parameters()).device
        z = unpack_latents(latents, height // self.vae_scale, width // self.vae_scale).to(device, vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(device, z.dtype)
        # diffusers divides by the reciprocal of std made in the VAE dtype; kept for identical bits.
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(device, z.dtype)
        video = vae.decode(z / inv_std + mean, return_dict=False)[0]  # [1, 3, 1, H, W]
        return video_to_uint8(video)

    # -- record --

    def record(
        self,
        plan: QwenImagePlan,
        final: torch.Tensor,
        frames: np.ndarray,
        timings: dict[str, float],
        memory: dict[str, float],
        loras: LoRAReport | None = None,
    ) -> GenerationResult:
        """The GenerationResult: frames and final latents [1, C, 1, H/8, W/8] (fp32, CPU) with their
        sha256, timings, fingerprint, attention providers and the request as recorded."""
        request = plan.request
        latents = unpack_latents(final, request.height // self.vae_scale, request.width // self.vae_scale)
        latents = latents.detach().to("cpu", torch.float32)
        frames.flags.writeable = False
        providers = dict.fromkeys(ATTENTION_SITES, f"{plan.attention.name}:{plan.attention.provider}")
        source = self.components.source
        args = {
            "pipeline": type(self).__name__,
            "model": None if source is None else str(source),
            "variant": self.variant,
            **request.record(),
            "guided": plan.guided,
            "noise": plan.noise_source,
            "dtype": str(self.dtype).removeprefix("torch."),
            "vae_dtype": str(self.vae.dtype).removeprefix("torch."),
            "device": str(self.device),
            "fps": DEFAULTS.fps,  # one image; GenerationResult.save reads it (a png ignores it)
            "memory_plan": plan.memory.record(),
            "template_prefix_tokens": self.components.text_encoder.prefix_tokens,  # Qwen's tokenizer: 34
            "defaults": DEFAULTS.chosen_by,  # where the values of fields left out came from
        }
        args.update(self._variant_args(plan))
        if plan.warnings:
            args["warnings"] = list(plan.warnings)
        if plan.preset is not None:
            args["preset_settings"] = plan.preset.to_json()
        fingerprint = environment_fingerprint(
            device=self.device, dtype=self.dtype, attention_providers=providers
        )
        if loras is not None:
            args["loras"] = loras.to_json()
            fingerprint["loras"] = loras.identity()
        return GenerationResult(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents=latents,
            latents_sha256=tensor_sha256(latents),
            timings=timings,
            fingerprint=fingerprint,
            attention_providers=providers,
            args=args,
            memory=memory,
        )

    def _elapsed(self, tick: float) -> float:
        synchronize(self.device)  # timings show finished GPU work, not queued launches
        return time.perf_counter() - tick
