"""Wan's hooks (pipelines.family.FamilyHooks): what the one prepare -> run -> record does differently for Wan.

Every Wan variant (T2V, T2I, I2V, TI2V, VACE, Wan2.2's two experts) is one WanHooks: the variant is
data the hooks read from the pipeline (pipelines.wan_variant). Latents are float32 [1, z_dim, R + F',
H/8, W/8] through the loop (R: VACE's reference frames, dropped by the conditioning's finalize);
text is UMT5's, zero-padded to max_sequence_length and attended densely (DESIGN.md); the model call
is the Wan DiT's with its DiTAttention metadata (pipelines.denoise.dit_call); guidance is diffusers'
`uncond + s * (cond - uncond)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.parallel.attention import self_attention_provider
from pipelines.conditioning import build_conditioning, encode_control, encode_image, encode_text
from pipelines.denoise import Conditioning, DenoiseModels, StepPlan, dit_call, guide
from pipelines.family import Decisions, Stage
from pipelines.plan import GenerationPlan
from pipelines.record import RECORDED_FIELDS
from pipelines.request import GenerationRequest
from pipelines.run import RunOutput
from pipelines.step_cache import ResolvedAccel
from pipelines.wan_plan import decide, make_scheduler, plan_steps_of, resolve_defaults

# The DiT sites that run the selected attention impl (the text encoder has its own dense attention).
ATTENTION_SITES = ("transformer.self_attn", "transformer.cross_attn")


class WanHooks:
    """The Wan family's hooks; stateless (one instance serves every Wan pipeline)."""

    # -- prepare --

    def resolve(
        self, pipeline: Any, request: GenerationRequest, *, seeded: bool
    ) -> tuple[GenerationRequest, str | None]:
        return resolve_defaults(request, pipeline, seeded=seeded)

    def decide(
        self, pipeline: Any, request: GenerationRequest, lossy: ResolvedAccel, attention: Any
    ) -> Decisions:
        return decide(pipeline, request, lossy, attention)

    def scheduler(self, pipeline: Any, request: GenerationRequest) -> Any:
        return make_scheduler(pipeline, request)

    def steps(self, pipeline: Any, request: GenerationRequest, scheduler: Any) -> tuple[StepPlan, ...]:
        return plan_steps_of(pipeline, request, scheduler)

    # -- run --

    def initial_latents(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        generator: torch.Generator | None,
        latents: torch.Tensor | None,
    ) -> torch.Tensor:
        return initial_latents(pipeline, plan, generator, latents)

    def encode_text(
        self, pipeline: Any, plan: GenerationPlan, prompts: list[str], text_stream: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_text(pipeline, prompts, plan.request.max_sequence_length, text_stream)

    def encode_condition(self, pipeline: Any, plan: GenerationPlan, stage: Stage) -> Any:
        """(image parts or None, VACE control or None): the image's latents/embeddings, the control context."""
        request = plan.request
        image = control = None
        if request.image is not None:
            with stage("image_encode"):
                size = (request.height, request.width, request.num_frames)
                image = encode_image(pipeline, request.image, *size)
        if pipeline.variant.control:
            with stage("control_encode"):
                control = encode_control(pipeline, request)
        return image, control

    def conditioning(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        text: torch.Tensor,
        text_lens: torch.Tensor,
        condition: Any,
        latents: torch.Tensor,
    ) -> Conditioning:
        image, control = condition
        return build_conditioning(pipeline, text, text_lens, image, control, plan.request.vace_scale)

    def call(
        self,
        model: Any,
        x: torch.Tensor,
        step: StepPlan,
        branch: Any,
        conditioning: Any,
        models: DenoiseModels,
    ) -> torch.Tensor:
        return dit_call(model, x, step, branch, conditioning, models)

    def guide(self, outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
        return guide(outputs, scale)

    def unpack(self, pipeline: Any, plan: GenerationPlan, latents: torch.Tensor) -> torch.Tensor:
        return latents  # the loop's latents are the VAE's layout already

    # -- record --

    def attention_providers(self, pipeline: Any, plan: GenerationPlan) -> dict[str, str]:
        """The kernel provider each DiT attention site ran ('flash:fa3', 'sdpa:...', '... e4m3')."""
        attention = plan.attention
        providers = dict.fromkeys(ATTENTION_SITES, f"{attention.name}:{attention.provider}")
        providers["transformer.self_attn"] = self_attention_provider(attention, pipeline.layout)
        if plan.fp8.attention:
            providers["transformer.self_attn"] += " e4m3"
        return providers

    def recorded_args(self, pipeline: Any, plan: GenerationPlan, output: RunOutput) -> dict[str, Any]:
        """The variant's task, RECORDED_FIELDS, VACE's inputs, the parallel layout."""
        request = plan.request.record()
        args: dict[str, Any] = {
            "variant": pipeline.variant.task,
            **{name: request[name] for name in RECORDED_FIELDS},
        }
        if pipeline.variant.control:
            args.update(vace_args(plan.request))
        if not pipeline.layout.is_single:
            args["parallel"] = pipeline.layout.describe()
        return args


def vace_args(request: Any) -> dict[str, Any]:
    """A VACE request's inputs as recorded: each video, mask and reference image by source and sha256."""
    args: dict[str, Any] = {"vace_scale": request.vace_scale}
    for name in ("video", "mask"):
        video = getattr(request, name)
        if video is not None:
            args.update({name: video.source, f"{name}_sha256": video.sha256})
    if request.reference_images:
        args["reference_images"] = [image.source for image in request.reference_images]
        args["reference_images_sha256"] = [image.sha256 for image in request.reference_images]
    return args


def initial_latents(
    pipeline: Any, plan: GenerationPlan, generator: torch.Generator | None, latents: torch.Tensor | None
) -> torch.Tensor:
    """float32 [1, z_dim, R + F', H/8, W/8] on the model's device: given, or standard normal from the CPU.

    R: VACE's reference images, whose frames lead the latents until the loop drops them.
    """
    request = plan.request
    references = len(request.reference_images)
    shape = pipeline.latents_shape(request.height, request.width, request.num_frames, references)
    if latents is not None:
        if not isinstance(latents, torch.Tensor) or tuple(latents.shape) != shape:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValidationError(f"latents: expected shape {shape} for this request, got {got}")
        return latents.to(device=pipeline.device, dtype=torch.float32)
    if generator is None:
        generator = torch.Generator("cpu").manual_seed(request.seed)
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(pipeline.device)
