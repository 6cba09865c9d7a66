"""Wan's part of prepare: defaults and model checks, VACE's refusals, the memory plan, FP8, the schedule.

pipelines.plan.prepare calls these through pipelines.wan_family.WanHooks; the server's model check
calls `resolve_defaults` on a pipeline's described facts (mmgen.serve.replicas.ModelFacts).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import fp8_layers_for
from mmgen.models.settings import ExecutionSettings
from mmgen.placement.policy import MemoryPlan
from pipelines.checks import check_num_frames, check_size
from pipelines.denoise import StepPlan, plan_steps
from pipelines.family import Decisions
from pipelines.fp8_choice import Fp8Context, choose_fp8
from pipelines.image_input import size_for_image
from pipelines.memory import model_sizes, resolve_plan, workload
from pipelines.presets import PRESETS, check_family, preset_value
from pipelines.request import GenerationRequest
from pipelines.step_cache import ResolvedAccel


def decide(pipeline: Any, request: GenerationRequest, lossy: ResolvedAccel, attention: Any) -> Decisions:
    """The memory plan, the FP8 choice and the model calls' settings of a resolved Wan request."""
    if pipeline.variant.control:
        refuse_for_vace(request, lossy)
    # Explicit FP8 linears are planned for (their weight copies stay on the device); a preset's
    # are optional: planned without, then skipped when the plan has no room for them.
    wanted = fp8_layers_for(pipeline.experts[0].config.dim) if lossy.fp8_linear else frozenset()
    memory = memory_plan(pipeline, request, frozenset() if "fp8_linear" in lossy.from_preset else wanted)
    fp8 = choose_fp8(lossy, Fp8Context.of(pipeline, memory, attention), wanted)
    settings = ExecutionSettings(
        ffn_chunk=memory.ffn_chunk,
        block_chunk=memory.block_chunk,
        fp8_layers=fp8.linear_layers,
        fp8_attention=fp8.attention,
    )
    return Decisions(memory=memory, fp8=fp8, settings=settings)


def resolve_defaults(
    request: GenerationRequest, pipeline: Any, *, seeded: bool = True
) -> tuple[GenerationRequest, str | None]:
    """The request with the model's defaults filled in and checked against the model, and the size rule.

    Model-dependent checks: an image where the variant needs (or refuses) one, a second guidance
    scale only with two experts, sides a multiple of the model's spatial multiple, a frame count
    that the VAE's temporal stride and the DiT's temporal patch divide.
    """
    defaults, variant = pipeline.defaults, pipeline.variant
    several = variant.capabilities().several_refusals(request, "Wan")  # one input image
    if several:
        raise ValidationError("; ".join(several))
    check_vace_inputs(request, variant.control)
    if variant.control:
        check_vace_scale_count(request, len(pipeline.transformer.config.vace_layers))
    if request.image is None and variant.requires_image:
        raise ValidationError(
            "this checkpoint is image-to-video (I2V): pass image= (a PNG/JPEG/WebP path or uint8 array)"
        )
    if request.image is not None and not variant.accepts_image:
        raise ValidationError(
            "image given, but this checkpoint is text-to-video only (no image conditioning)"
        )
    if request.guidance_scale_2 is not None and variant.experts == 1:
        raise ValidationError("guidance_scale_2 needs a two-expert checkpoint (Wan2.2 A14B: boundary_ratio)")
    height, width, size_rule = request.height, request.width, None
    if request.image is not None and height is None and width is None:
        area = defaults.height * defaults.width
        height, width, size_rule = size_for_image(request.image, area, pipeline.spatial_multiple)
    given = request.video if request.video is not None else request.mask
    if given is not None and height is None and width is None:
        height, width = given.height, given.width
        size_rule = f"the VACE {'video' if request.video is not None else 'mask'}'s own size"
    if given is not None and request.num_frames is None:
        request = request.with_values(num_frames=given.num_frames)
    preset = check_family(request.preset, "wan")  # a Qwen-Image preset is refused, naming Wan's
    num_frames = check_num_frames(
        defaults.num_frames if request.num_frames is None else request.num_frames, pipeline.temporal_stride
    )
    patch_t = pipeline.transformer.config.patch_size[0]
    if ((num_frames - 1) // pipeline.temporal_stride + 1) % patch_t:
        raise ValidationError(
            f"num_frames = {num_frames}: its latent frame count must be a multiple of the patch size {patch_t}"
        )
    steps = preset_value(preset, "num_inference_steps", request.num_inference_steps)
    guidance = preset_value(preset, "guidance_scale", request.guidance_scale)
    seed = secrets.randbits(63) if request.seed is None and seeded else request.seed
    filled = {
        "negative_prompt": defaults.negative_prompt
        if request.negative_prompt is None
        else request.negative_prompt,
        "height": check_size(
            "height", defaults.height if height is None else height, pipeline.spatial_multiple
        ),
        "width": check_size("width", defaults.width if width is None else width, pipeline.spatial_multiple),
        "num_frames": num_frames,
        "num_inference_steps": defaults.num_inference_steps if steps is None else steps,
        "guidance_scale": float(defaults.guidance_scale if guidance is None else guidance),
        "seed": seed,
        "max_sequence_length": request.max_sequence_length
        or defaults.max_sequence_length
        or pipeline.transformer.config.text_len,
    }
    request = request.with_values(**{k: v for k, v in filled.items() if v is not None})
    check_vace_sizes(request)
    return request, size_rule


VACE_FIELDS = ("video", "mask", "reference_images")


def check_vace_inputs(request: GenerationRequest, control: bool) -> None:
    """VACE's fields only for a VACE checkpoint (control: the pipeline's variant takes a control context)."""
    given = [name for name in VACE_FIELDS if getattr(request, name)]
    given += ["vace_scale"] if request.vace_scale != 1.0 else []
    if given and not control:
        raise ValidationError(
            f"{', '.join(given)}: need a Wan VACE checkpoint (this one takes no control video)"
        )


def check_vace_scale_count(request: GenerationRequest, blocks: int) -> None:
    """A list of VACE scales has one per VACE block of the model (`blocks`)."""
    scale = request.vace_scale
    if isinstance(scale, tuple) and len(scale) != blocks:
        raise ValidationError(
            f"vace_scale: {len(scale)} numbers given, but this model has {blocks} VACE blocks; give one "
            f"number (every block) or {blocks} (one per block, in block order)"
        )


def check_vace_sizes(request: GenerationRequest) -> None:
    """The control video and mask have exactly the request's frames and size (mmgen never resamples them)."""
    wanted = (request.num_frames, request.height, request.width)
    for name in ("video", "mask"):
        video = getattr(request, name)
        if video is not None and (video.num_frames, video.height, video.width) != wanted:
            raise ValidationError(
                f"{name}: {video.num_frames} frames of {video.width}x{video.height}, but the request is "
                f"{wanted[0]} frames of {wanted[2]}x{wanted[1]}; give a {name} of exactly that (nothing is resampled)"
            )
    for image in request.reference_images:
        if min(image.height, image.width) < 8:
            raise ValidationError(
                f"reference_images: {image.source} is {image.width}x{image.height}; each side must be at least 8"
            )


def refuse_for_vace(request: GenerationRequest, lossy: ResolvedAccel) -> None:
    """What a Wan VACE request cannot use yet: one line each, rather than half-supporting it."""
    if lossy.step_cache is not None:
        raise ValidationError("Wan VACE: the step cache is not supported yet (the hints are not cached)")
    if request.lora:
        raise ValidationError("Wan VACE: LoRAs are not supported yet (not matched against the VACE blocks)")


def memory_plan(
    pipeline: Any, request: GenerationRequest, fp8_layers: frozenset[str] = frozenset()
) -> MemoryPlan:
    """The request's MemoryPlan (offload / gpu_memory_gb None take the pipeline's); raises when it cannot fit.

    fp8_layers: the FP8 linear kinds the request runs; their weight copies count with offload none.
    Off CUDA a plan that offloads or has a budget says that it does not apply (MemoryPlan.note).
    """
    work = workload(
        pipeline.latents_shape(
            request.height, request.width, request.num_frames, len(request.reference_images)
        ),
        pipeline.transformer.config.patch_size,
        guided=request.guidance_scale > 1.0,
        text_len=request.max_sequence_length,
        size=(request.num_frames, request.height, request.width),
    )
    plan = resolve_plan(
        model_sizes(pipeline.experts, pipeline.components.text_encoder, pipeline.vae, fp8_layers),
        work,
        offload=pipeline.offload if request.offload is None else request.offload,
        gpu_memory_gb=pipeline.gpu_memory_gb if request.gpu_memory_gb is None else request.gpu_memory_gb,
        cfg=request.cfg,
        ffn_chunk=request.ffn_chunk,
        decode=request.decode,
        block_chunk=request.block_chunk,
    )
    if pipeline.variant.control and plan.offload != "none":
        raise ValidationError(
            f"Wan VACE: offload = {plan.offload!r} is not supported yet (its plan needs no offload)"
        )
    if pipeline.has_own_placement and plan.offload != "none":
        raise ValidationError(
            f"offload = {plan.offload!r}: this pipeline was built with its own placement; "
            "offload needs the pipeline's (build it without placement=)"
        )
    device = pipeline.device.type
    if device != "cuda" and (plan.offload != "none" or plan.budget_gib is not None):
        note = (
            f"device {device}: the weights are in host memory either way; offload and gpu_memory_gb "
            "save no device memory here (the plan runs as a functional check)"
        )
        plan = dataclasses.replace(plan, note=note)
    return plan


def make_scheduler(pipeline: Any, request: GenerationRequest) -> Any:
    """A fresh scheduler for this request, its timesteps set (the preset's, or the checkpoint's own)."""
    if request.preset is not None:
        scheduler = PRESETS[request.preset].scheduler(pipeline.device)
    else:
        config = pipeline.components.scheduler.config
        scheduler = type(pipeline.components.scheduler).from_config(config)
        scheduler.set_timesteps(request.num_inference_steps, device=pipeline.device)
    scheduler.set_begin_index(0)
    return scheduler


def plan_steps_of(pipeline: Any, request: GenerationRequest, scheduler: Any = None) -> tuple[StepPlan, ...]:
    """Per timestep of the request's schedule: which expert runs it and with which guidance scale."""
    scheduler = make_scheduler(pipeline, request) if scheduler is None else scheduler
    scales: tuple[float, ...] = (request.guidance_scale,)
    if pipeline.variant.experts == 2:
        second = request.guidance_scale if request.guidance_scale_2 is None else request.guidance_scale_2
        scales = (request.guidance_scale, second)
    boundary = pipeline.variant.boundary_timestep(scheduler.config.num_train_timesteps)
    return plan_steps(scheduler.timesteps, scales, boundary)
