"""prepare: a GenerationRequest and a loaded pipeline -> a frozen GenerationPlan (DESIGN.md, "One request value").

Everything a call decides happens here, before the first step and before any weight moves: the
model's defaults filled into the request and its model-dependent checks, the lossy settings
resolved, the attention impl, the memory plan, the FP8 decision with its reasons, the LoRA set,
the schedule with the expert of every step, and the ExecutionSettings the model calls get. One
function for every family: where families differ it calls the pipeline's hooks
(pipelines.family.FamilyHooks). `pipelines.run` executes the plan; `pipelines.record` writes the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmgen.attention.impls import AttentionImpl
from mmgen.lora.request import LoRARequest
from mmgen.models.settings import ExecutionSettings
from mmgen.placement.policy import MemoryPlan
from pipelines.denoise import DenoiseOptions, StepPlan
from pipelines.fp8_choice import Fp8Choice
from pipelines.request import GenerationRequest
from pipelines.step_cache import ResolvedAccel, resolve_accel


@dataclass(frozen=True)
class GenerationPlan:
    """One call, decided. `request` has the model's defaults filled in (what result.args records).

    size_rule: how height and width came from an input (image, control video), when they did.
    lossy: the accel preset resolved (step cache, CFG truncation, FP8 flags as asked). fp8: what runs
    in FP8 and the preset parts skipped, with reasons. steps: per scheduler timestep, the expert and
    guidance scale. settings: what every DiT call gets (its block_stream is the placement's, filled
    in by run).
    """

    request: GenerationRequest
    size_rule: str | None
    lossy: ResolvedAccel
    memory: MemoryPlan
    attention: AttentionImpl
    fp8: Fp8Choice
    steps: tuple[StepPlan, ...]
    settings: ExecutionSettings
    options: DenoiseOptions

    @property
    def guided(self) -> bool:
        # diffusers' rule: classifier-free guidance only when the scale exceeds 1 (and a negative
        # prompt exists: Qwen-Image's true CFG; Wan always has one, its default is "").
        request = self.request
        return request.guidance_scale > 1.0 and request.negative_prompt is not None

    @property
    def loras(self) -> tuple[LoRARequest, ...]:
        return self.request.lora


def prepare(request: GenerationRequest, pipeline: Any, *, seeded: bool = True) -> GenerationPlan:
    """The plan of `request` on `pipeline` (any family's); every error comes before any work.

    seeded: draw a fresh random seed when the request has none (False when the caller brings its
    own generator or latents: the noise then does not come from a seed).
    """
    hooks = pipeline.hooks
    request, size_rule = hooks.resolve(pipeline, request, seeded=seeded)
    lossy = resolve_accel(
        request.accel, request.step_cache, request.cfg_truncation, request.fp8_linear, request.fp8_attention
    )
    attention = pipeline.attention_for(request.attention_backend)
    decided = hooks.decide(pipeline, request, lossy, attention)
    return GenerationPlan(
        request=request,
        size_rule=size_rule,
        lossy=lossy,
        memory=decided.memory,
        attention=attention,
        fp8=decided.fp8,
        steps=hooks.steps(pipeline, request, hooks.scheduler(pipeline, request)),
        settings=decided.settings,
        options=DenoiseOptions(
            cfg=decided.memory.cfg, step_cache=lossy.step_cache, cfg_truncation=lossy.cfg_truncation
        ),
    )
