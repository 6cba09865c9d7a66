"""record: a GenerationPlan and its RunOutput -> the GenerationResult (identity, timings, fingerprint, args).

One function for every family. result.args, the recorded request, is the family's part
(FamilyHooks.recorded_args: its variant and the request fields it records, from the request value's
own record with the model's defaults filled in by prepare) plus what every family records: the
prompt the encoder saw, what the plan resolved (the memory plan, the lossy settings and their
presets, the FP8 layer kinds), the LoRA report, the noise source, dtypes and device. Lossy fields
appear only when set, so the args of a lossless call stay what they were.
"""

from __future__ import annotations

from typing import Any

import torch

from mmgen.fingerprint import environment_fingerprint
from mmgen.outputs.writers import frames_sha256, tensor_sha256
from pipelines.common import GenerationResult
from pipelines.plan import GenerationPlan
from pipelines.presets import PRESETS
from pipelines.request_properties import recorded_fields
from pipelines.run import RunOutput
from pipelines.step_cache import ACCEL_PRESETS

# The request fields a family records from the request's record when it records a subset (Wan; the
# memory fields are in args['memory_plan'], the LoRAs in args['loras'], the lossy ones only when set):
# those the request declares `recorded`.
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
    providers = pipeline.hooks.attention_providers(pipeline, plan)
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


def recorded_args(
    pipeline: Any,
    plan: GenerationPlan,
    output: RunOutput,
    *,
    generator: torch.Generator | None = None,
    latents: torch.Tensor | None = None,
) -> dict[str, Any]:
    """The resolved request as a JSON-ready dict (what reproduces this result)."""
    args: dict[str, Any] = {
        "pipeline": type(pipeline).__name__,
        "model": None if pipeline.components.source is None else str(pipeline.components.source),
        **pipeline.hooks.recorded_args(pipeline, plan, output),
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
    images = plan.request.images
    if len(images) == 1:
        image = images[0]
        args.update(image=image.source, image_sha256=image.sha256, image_size=[image.width, image.height])
    elif images:  # several (Qwen-Image-2.1's condition images): one entry per image, in order
        args.update(
            image=[image.source for image in images],
            image_sha256=[image.sha256 for image in images],
            image_size=[[image.width, image.height] for image in images],
        )
    if output.prompt_original is not None:
        args["prompt_original"] = output.prompt_original
    args["memory_plan"] = plan.memory.record()
    args.update(_resolved_lossy(plan, output))
    if output.lora_report is not None:
        args["loras"] = output.lora_report.to_json()
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
