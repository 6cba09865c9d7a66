"""Qwen-Image's hooks (pipelines.family.FamilyHooks): what the one prepare -> run -> record does differently.

Numerically this is diffusers' QwenImagePipeline: the same prompt template and prefix drop, seeded
CPU noise of the same shape, dtype and 2x2 packing (a seed reproduces a diffusers image), the same
FlowMatch Euler schedule (sigmas linspace(1, 1/steps), dynamic shift mu from the image token count),
the same norm-preserving true CFG, latent denormalization and uint8 conversion. It differs in how
the work runs: the conditional and unconditional prompts (each its own length) go through the
transformer as ONE call of batch 2 whose joint attention is varlen over each sample's own
[text_b, image] tokens (mmgen.models.qwen_image_joint), where diffusers makes two calls per step;
cfg 'sequential' makes diffusers' two calls, each prompt cut to its own length.

The loop's latents are packed [1, N, 4C] in the model dtype; `unpack` gives [1, C, 1, H/8, W/8].
`guidance_scale` is Qwen-Image's true CFG scale (diffusers' `true_cfg_scale`): CFG runs when it is
> 1 and a negative prompt is given (even " "), as in diffusers (GenerationPlan.guided).

Qwen-Image-Edit (pipelines.qwen_image_edit.QwenImageEditHooks) overrides the hooks marked as variant
hooks here: a conditioning image whose packed latents ride after the noise tokens in every call
(QwenImageConditioning.grids: the noise grid, then the image's), the prediction cut back to the
noise tokens.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmgen.errors import ValidationError
from mmgen.models.qwen_image import true_cfg_combine
from mmgen.models.qwen_image_joint import JointTokens
from mmgen.models.qwen_image_prompt import MAX_TEXT_TOKENS, templated_prompts
from mmgen.placement.policy import MemoryPlan
from pipelines.checks import offload_refusals
from pipelines.denoise import BranchedConditioning, DenoiseModels, StepPlan, plan_steps
from pipelines.family import Decisions, Stage
from pipelines.plan import GenerationPlan
from pipelines.presets import Preset, check_family, preset_value
from pipelines.request import GenerationRequest
from pipelines.run import RunOutput
from pipelines.step_cache import ResolvedAccel

FAMILY = "qwen-image"  # pipelines.presets: the presets this family takes
ATTENTION_SITES = ("transformer.joint_attn",)


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
class JointBranch:
    """One transformer call's text [b, L, D] (model dtype, device) and its JointTokens (built once)."""

    text: torch.Tensor
    metadata: JointTokens

    @property
    def batch(self) -> int:
        return self.text.shape[0]


@dataclass(frozen=True)
class QwenImageConditioning(BranchedConditioning):
    """A Qwen-Image request's conditioning for the loop (pipelines.family.LoopConditioning).

    both: all prompts in one call (text padded to the longest, varlen joint layout); halves: each
    prompt alone, cut to its own length (no padding at all), () unguided. grids: the token grids in
    token order (the noise's, then a condition's); noise_tokens: N; condition: packed image latents
    [1, M, 4C] after the noise tokens in every call (Edit), or None.
    """

    both: JointBranch
    halves: tuple[JointBranch, ...]
    grids: tuple[tuple[int, int, int], ...]
    noise_tokens: int
    condition: torch.Tensor | None = None

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        return latents if self.condition is None else torch.cat([latents, self.condition], dim=1)


class QwenImageHooks:
    """Qwen-Image T2I's hooks; stateless. Edit subclasses the variant hooks (refusals, variant_defaults,
    size_rule, condition_size, encode_text, encode_condition, variant_args)."""

    title = "Qwen-Image"  # how refusals name the pipeline

    # -- prepare --

    def resolve(
        self, pipeline: Any, request: GenerationRequest, *, seeded: bool
    ) -> tuple[GenerationRequest, str | None]:
        """Refusals first (one line per field), then this family's defaults, the preset's values and a
        seed; then the size, text length and schedule checks."""
        refused = self.refusals(pipeline, request)
        if refused:
            raise ValidationError("; ".join(refused))
        preset = check_family(request.preset, FAMILY)  # a Wan preset: one line naming this family's
        defaults = {**pipeline.defaults.request_values(), **self.variant_defaults(request)}
        filled = {name: value for name, value in defaults.items() if getattr(request, name) is None}
        for name in ("num_inference_steps", "guidance_scale"):  # the preset's, when it fixes them
            value = preset_value(preset, name, getattr(request, name))
            if value is not None and getattr(request, name) is None:
                filled[name] = value
        if request.seed is None and seeded:
            filled["seed"] = secrets.randbits(63)
        request = request.with_values(**filled) if filled else request
        multiple = pipeline.spatial_multiple
        for name in ("height", "width"):
            if getattr(request, name) % multiple:
                raise ValidationError(f"{name} = {getattr(request, name)}: must be a multiple of {multiple}")
        if request.max_sequence_length > MAX_TEXT_TOKENS:
            raise ValidationError(
                f"max_sequence_length = {request.max_sequence_length}: at most {MAX_TEXT_TOKENS} for Qwen-Image"
            )
        config = scheduler_config(pipeline, preset)
        if request.num_inference_steps == 1 and config.get("shift_terminal"):
            raise ValidationError(
                f"num_inference_steps = 1: the scheduler's shift_terminal ({config['shift_terminal']}) "
                "stretches a one-step schedule to a NaN sigma (diffusers' too); use 2 or more"
            )
        return request, self.size_rule(request)

    def refusals(self, pipeline: Any, request: GenerationRequest) -> list[str]:
        """One line per request field this pipeline cannot honour: those its capabilities
        (pipelines.capabilities) do not take, and what the loaded pipeline fixes (variant hook: Edit
        adds its own)."""
        refused = pipeline.capabilities.refusals(request, self.title)
        refused += offload_refusals(pipeline.offload, request)
        if request.num_frames not in (None, 1):
            refused.append(f"num_frames = {request.num_frames}: Qwen-Image makes one image (1 frame)")
        return refused

    def variant_defaults(self, request: GenerationRequest) -> dict[str, Any]:
        """Variant hook: request values this variant defaults differently from the family's (T2I: none)."""
        return {}

    def size_rule(self, request: GenerationRequest) -> str | None:
        """Variant hook: how the output size came from an input (T2I: it did not)."""
        return None

    def condition_size(self, request: GenerationRequest) -> tuple[int, int] | None:
        """Variant hook: the conditioning image's (height, width) as encoded (T2I: no condition)."""
        return None

    def decide(
        self, pipeline: Any, request: GenerationRequest, lossy: ResolvedAccel, attention: Any
    ) -> Decisions:
        """No memory planner, FP8 or chunking yet (refused in resolve): the offload chosen at load, the cfg mode."""
        return Decisions(memory=MemoryPlan(offload=pipeline.offload, cfg=request.cfg or "batch"))

    def scheduler(self, pipeline: Any, request: GenerationRequest) -> Any:
        """FlowMatch Euler on diffusers' sigmas for the step count (a preset's: its own), mu from the
        noise token count under the config in use (the preset's, else the checkpoint's)."""
        preset = check_family(request.preset, FAMILY)
        config = scheduler_config(pipeline, preset)
        mu = schedule_shift(pipeline, request)
        if preset is not None:
            scheduler = preset.scheduler(pipeline.device, mu=mu)
        else:
            steps = request.num_inference_steps
            sigmas = np.linspace(1.0, 1 / steps, steps).tolist()
            scheduler = type(pipeline.components.scheduler).from_config(dict(config))
            scheduler.set_timesteps(sigmas=sigmas, device=pipeline.device, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def steps(self, pipeline: Any, request: GenerationRequest, scheduler: Any) -> tuple[StepPlan, ...]:
        return plan_steps(scheduler.timesteps, (request.guidance_scale,))

    # -- run --

    def initial_latents(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        generator: torch.Generator | None,
        latents: torch.Tensor | None,
    ) -> torch.Tensor:
        """Packed [1, N, 4C] in the model dtype on the device. Given: packed, or [1, C, 1, H/8, W/8] as
        result.latents holds them. Drawn as diffusers draws it: standard normal [1, 1, C, h, w] in the
        model dtype from a CPU generator, then packed."""
        request = plan.request
        channels = pipeline.transformer.config.in_channels // 4
        height, width = request.height // pipeline.vae_scale, request.width // pipeline.vae_scale
        packed = (1, (height // 2) * (width // 2), channels * 4)
        if latents is not None:
            grid = (1, channels, 1, height, width)
            if not isinstance(latents, torch.Tensor) or tuple(latents.shape) not in (packed, grid):
                got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
                raise ValidationError(
                    f"latents: expected {packed} (packed) or {grid} for this request, got {got}"
                )
            latents = latents if latents.dim() == 3 else pack_latents(latents)
            return latents.to(device=pipeline.device, dtype=pipeline.dtype)
        if generator is None:
            generator = torch.Generator("cpu").manual_seed(request.seed)
        return draw_noise(generator, channels, height, width, pipeline.dtype).to(pipeline.device)

    @torch.no_grad()
    def encode_text(
        self, pipeline: Any, plan: GenerationPlan, prompts: list[str], text_stream: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Variant hook. Prompts -> (text [B, L, joint_attention_dim] in the encoder's dtype on the
        device, zero-padded; text_lens int64 [B] on the CPU), each prompt encoded alone in the chat
        template."""
        components = pipeline.components
        encoder = components.text_encoder
        limit = MAX_TEXT_TOKENS + encoder.prefix_tokens  # diffusers' tokenizer max_length
        ids = [components.tokenizer.encode(text, max_length=limit) for text in templated_prompts(prompts)]
        text, text_lens = encoder.encode(ids, max_tokens=plan.request.max_sequence_length)
        return text.to(pipeline.device), text_lens

    def encode_condition(self, pipeline: Any, plan: GenerationPlan, stage: Stage) -> torch.Tensor | None:
        """Variant hook: the conditioning image's packed latents [1, M, 4C] (model dtype, device); T2I: None."""
        return None

    def conditioning(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        text: torch.Tensor,
        text_lens: torch.Tensor,
        condition: torch.Tensor | None,
        latents: torch.Tensor,
    ) -> QwenImageConditioning:
        """The branches' text and JointTokens, built once; the token grids; the condition tokens."""
        noise_tokens = latents.shape[1]
        image_tokens = noise_tokens + (0 if condition is None else condition.shape[1])
        device = pipeline.device

        def branch(rows: torch.Tensor, lens: Any) -> JointBranch:
            tokens = JointTokens.build(lens, image_tokens, text_width=rows.shape[1], device=device)
            return JointBranch(rows, tokens)

        halves = ()
        if text.shape[0] == 2:  # each prompt alone, cut to its own length
            lengths = [int(length) for length in text_lens]
            halves = tuple(branch(text[row : row + 1, :n], [n]) for row, n in enumerate(lengths))
        grids = (noise_grid(pipeline, plan.request),)
        size = self.condition_size(plan.request)
        if size is not None:
            grids += (token_grid(pipeline, *size),)  # RoPE gives it frame index 1: it comes second
        return QwenImageConditioning(branch(text, text_lens), halves, grids, noise_tokens, condition)

    def call(
        self,
        model: Any,
        x: torch.Tensor,
        step: StepPlan,
        branch: JointBranch,
        conditioning: QwenImageConditioning,
        models: DenoiseModels,
    ) -> torch.Tensor:
        """One transformer call over [noise (+ condition)] tokens for `branch`'s prompts -> the
        prediction of the N noise tokens [b, N, 4C]."""
        batch = branch.batch
        timestep = step.timestep.expand(x.shape[0]).to(x.dtype) / 1000
        prediction = model(
            x.expand(batch, -1, -1),
            timestep.expand(batch),
            branch.text,
            grids=conditioning.grids,
            attention=models.attention,
            metadata=branch.metadata,
            settings=models.settings,
        )
        return prediction[:, : conditioning.noise_tokens]

    def guide(self, outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
        """Qwen-Image's norm-preserving true CFG (diffusers' QwenImagePipeline)."""
        return outputs[0] if len(outputs) == 1 else true_cfg_combine(outputs[0], outputs[1], scale)

    def unpack(self, pipeline: Any, plan: GenerationPlan, latents: torch.Tensor) -> torch.Tensor:
        request, scale = plan.request, pipeline.vae_scale
        return unpack_latents(latents, request.height // scale, request.width // scale)

    # -- record --

    def attention_providers(self, pipeline: Any, plan: GenerationPlan) -> dict[str, str]:
        return dict.fromkeys(ATTENTION_SITES, f"{plan.attention.name}:{plan.attention.provider}")

    def recorded_args(self, pipeline: Any, plan: GenerationPlan, output: RunOutput) -> dict[str, Any]:
        """Every request field, whether true CFG ran, the template's prefix token count, the variant's."""
        return {
            "variant": pipeline.variant,
            **plan.request.record(),
            "guided": plan.guided,
            "template_prefix_tokens": pipeline.components.text_encoder.prefix_tokens,  # Qwen's tokenizer: 34
            **self.variant_args(plan),
            **({"warnings": list(warnings(plan.request))} if warnings(plan.request) else {}),
        }

    def variant_args(self, plan: GenerationPlan) -> dict[str, Any]:
        """Variant hook: what this variant adds to the recorded args (T2I: nothing)."""
        return {}


def warnings(request: GenerationRequest) -> tuple[str, ...]:
    """What the request asks for that the plan does not do (recorded in result.args, shown by the faces)."""
    if request.guidance_scale > 1 and request.negative_prompt is None:  # diffusers warns too
        return (
            f"guidance_scale = {request.guidance_scale:g} is not applied: true CFG needs a negative "
            'prompt (even " "); without one the image is made unguided',
        )
    return ()


def scheduler_config(pipeline: Any, preset: Preset | None) -> Mapping[str, Any]:
    """The FlowMatch Euler config a call runs on: the preset's, else the checkpoint's."""
    return preset.scheduler_config if preset is not None else pipeline.components.scheduler.config


def schedule_shift(pipeline: Any, request: GenerationRequest) -> float:
    """mu: the dynamic shift for the output's token count, under the config the request runs on."""
    config = scheduler_config(pipeline, check_family(request.preset, FAMILY))
    _, rows, cols = noise_grid(pipeline, request)
    return calculate_shift(
        rows * cols,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )


def token_grid(pipeline: Any, height: int, width: int) -> tuple[int, int, int]:
    """(1, rows, cols): the transformer tokens of one image of height x width pixels."""
    pixels_per_token = pipeline.vae_scale * pipeline.transformer.config.patch_size
    return (1, height // pixels_per_token, width // pixels_per_token)


def noise_grid(pipeline: Any, request: GenerationRequest) -> tuple[int, int, int]:
    """The output image's token grid (1, rows, cols)."""
    return token_grid(pipeline, request.height, request.width)
