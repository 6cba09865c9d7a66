"""record: a GenerationPlan and its RunOutput -> the GenerationResult (identity, timings, fingerprint, args).

result.args, the recorded request, is the request value's own record (GenerationRequest.record(),
the model's defaults filled in by prepare) restricted to the fields results have always carried,
plus what the plan resolved: the memory plan, the lossy settings and their presets, the FP8 layer
kinds, the LoRA report, the noise source, dtypes and device. Lossy fields appear only when set, so
the args of a lossless call stay what they were.
"""

from __future__ import annotations

from typing import Any

import torch

from mmgen.fingerprint import environment_fingerprint
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from mmgen.parallel.attention import self_attention_provider
from pipelines.common import GenerationResult
from pipelines.plan import GenerationPlan
from pipelines.presets import PRESETS
from pipelines.request import recorded_fields
from pipelines.run import RunOutput
from pipelines.step_cache import ACCEL_PRESETS

# The DiT sites that run the selected attention impl (the text encoder has its own dense attention).
ATTENTION_SITES = ("transformer.self_attn", "transformer.cross_attn")
# The request fields result.args records (the memory fields are in args['memory_plan'], the LoRAs in
# args['loras']; the lossy ones only when set): those the request declares `recorded`.
RECORDED_FIELDS = recorded_fields()


def record(
    pipeline: Any,
    plan: GenerationPlan,
    output: RunOutput,
    *,
    generator: torch.Generator | None = None,
    latents: torch.Tensor | None = None,
) -> GenerationResult:
    """The result of `plan` run on `pipeline`: frames and their sha256, latents, timings, providers, args."""
    providers = attention_providers(pipeline, plan)
    fingerprint = environment_fingerprint(
        device=pipeline.device, dtype=pipeline.dtype, attention_providers=providers
    )
    if output.lora_report is not None:
        fingerprint["loras"] = output.lora_report.identity()
    return GenerationResult(
        frames=output.frames,
        frames_sha256=frames_sha256(output.frames),
        latents=output.latents,
        latents_sha256=tensor_sha256(output.latents),
        timings=output.timings,
        fingerprint=fingerprint,
        attention_providers=providers,
        args=recorded_args(pipeline, plan, output, generator=generator, latents=latents),
        memory=output.memory,
    )


def attention_providers(pipeline: Any, plan: GenerationPlan) -> dict[str, str]:
    """The kernel provider each DiT attention site ran ('flash:fa3', 'sdpa:...', '... e4m3')."""
    attention = plan.attention
    providers = dict.fromkeys(ATTENTION_SITES, f"{attention.name}:{attention.provider}")
    providers["transformer.self_attn"] = self_attention_provider(attention, pipeline.layout)
    if plan.fp8.attention:
        providers["transformer.self_attn"] += " e4m3"
    return providers


def recorded_args(
    pipeline: Any,
    plan: GenerationPlan,
    output: RunOutput,
    *,
    generator: torch.Generator | None = None,
    latents: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The resolved request as a JSON-ready dict (what reproduces this result)."""
    request = plan.request.record()
    args: dict[str, Any] = {
        "pipeline": type(pipeline).__name__,
        "model": None if pipeline.components.source is None else str(pipeline.components.source),
        "variant": pipeline.variant.task,
        **{name: request[name] for name in RECORDED_FIELDS},
        "prompt": output.prompt,
        "size_rule": plan.size_rule,
        **{name: value for name, value in _lossy(plan).items() if value is not None},
        "noise": "latents" if latents is not None else ("generator" if generator is not None else "seed"),
        "dtype": str(pipeline.dtype).removeprefix("torch."),
        "vae_dtype": str(pipeline.vae.dtype).removeprefix("torch."),
        "device": str(pipeline.device),
        "fps": pipeline.defaults.fps,
        "defaults": pipeline.defaults.chosen_by,  # where the values of arguments left out came from
    }
    if plan.request.image is not None:
        image = plan.request.image
        args.update(image=image.source, image_sha256=image.sha256, image_size=[image.width, image.height])
    if pipeline.variant.control:
        args.update(vace_args(plan.request))
    if not pipeline.layout.is_single:
        args["parallel"] = pipeline.layout.describe()
    if output.prompt_original is not None:
        args["prompt_original"] = output.prompt_original
    args["memory_plan"] = plan.memory.record()
    args.update(_resolved_lossy(plan, output))
    if output.lora_report is not None:
        args["loras"] = output.lora_report.to_json()
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


def _lossy(plan: GenerationPlan) -> dict[str, Any]:
    """The lossy request fields as they ran: the accel preset applied, skipped FP8 parts off (None)."""
    lossy = plan.lossy
    return {
        "step_cache": lossy.step_cache,
        "cfg_truncation": lossy.cfg_truncation,
        "accel": plan.request.accel,
        "fp8_linear": True if plan.fp8.linear_layers else None,
        "fp8_attention": True if plan.fp8.attention else None,
    }


def _resolved_lossy(plan: GenerationPlan, output: RunOutput) -> dict[str, Any]:
    """What the presets set, the preset parts skipped, the steps that reused the cache, the FP8 kinds."""
    request, extra = plan.request, {}
    if request.preset is not None:
        extra["preset_settings"] = PRESETS[request.preset].to_json()
    if request.accel is not None:
        extra["accel_settings"] = ACCEL_PRESETS[request.accel].to_json()
        if plan.fp8.skipped:
            extra["accel_skipped"] = dict(plan.fp8.skipped)
    if plan.lossy.step_cache is not None:
        extra["step_cache_reused"] = list(output.reused)
    if plan.fp8.linear_layers:
        extra["fp8_linear_layers"] = sorted(plan.fp8.linear_layers)
    return extra
