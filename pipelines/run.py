"""run: execute a GenerationPlan on its pipeline -> a RunOutput (frames, final latents, timings, peaks).

The stages, in order: the initial noise, the LoRAs (applied or kept), the weights placed for the
plan, text encoding, the conditioning inputs (an input image, VACE's control context, ...), the one
denoise loop (pipelines.denoise), the VAE decode. One function for every family: what differs is
the pipeline's hooks (pipelines.family.FamilyHooks). The plan decided everything; the only values
made here are the placement's block streams, which join the plan's ExecutionSettings for the model
calls, and the request's conditioning (its own per-request state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmgen.errors import ValidationError
from mmgen.lora.report import LoRAReport
from mmgen.parallel.share import from_first_rank
from mmgen.placement.offload import OffloadPlacement
from mmgen.placement.peaks import StagePeaks
from mmgen.progress import ProgressReporter, as_reporter
from pipelines.denoise import DenoiseModels, Placement, denoise
from pipelines.devices import StepFence
from pipelines.plan import GenerationPlan


@dataclass(frozen=True)
class RunOutput:
    """What a run made: uint8 frames [T, H, W, 3] (read-only), final float32 latents on the CPU,
    seconds and peak GiB per stage, the steps that reused the step cache, the LoRA report, and the
    prompt the text encoder saw (prompt_original: the caller's, when a prompt enhancer rewrote it)."""

    frames: np.ndarray
    latents: torch.Tensor
    timings: dict[str, float]
    memory: dict[str, float]
    reused: tuple[int, ...]
    lora_report: LoRAReport | None
    prompt: str
    prompt_original: str | None = None


class _Stages:
    """Times each stage (GPU work finished, not queued) and records its memory peak."""

    def __init__(self, pipeline: Any, plan: GenerationPlan) -> None:
        self.timings: dict[str, float] = {}
        self.peaks = StagePeaks(pipeline.device, release_cache=plan.memory.budget_gib is not None)
        self._synchronize = pipeline.synchronize

    @contextlib.contextmanager
    def stage(self, name: str, peak: str | None = None) -> Iterator[None]:
        tick = time.perf_counter()
        with self.peaks.stage(peak) if peak is not None else contextlib.nullcontext():
            yield
        self._synchronize()
        self.timings[name] = time.perf_counter() - tick


def run(
    pipeline: Any,
    plan: GenerationPlan,
    *,
    generator: torch.Generator | None = None,
    latents: torch.Tensor | None = None,
    progress: bool | ProgressReporter = True,
    prompt_enhancer: Callable[[str], str] | None = None,
) -> RunOutput:
    """Run `plan` on `pipeline` (any family's); see pipelines.pipeline.Pipeline.__call__."""
    started = time.perf_counter()
    request, hooks = plan.request, pipeline.hooks
    noise = hooks.initial_latents(pipeline, plan, generator, latents)
    # Before any denoising: read, check and apply (or keep) the LoRAs; errors leave the base weights.
    lora_report = pipeline.loras.use(
        pipeline.experts, plan.loras, mode=request.lora_mode, allow_unmatched=request.lora_allow_unmatched
    )
    placement = pipeline.arrange(plan)
    stages = _Stages(pipeline, plan)
    # Several ranks run this call together; only the one that owns outputs draws bars (True). A
    # reporter the caller passes is driven on every rank: each rank's caller decides what it does
    # (`mmgen serve --gpus N` broadcasts rank 0's cancel decision through it, mmgen.serve.group).
    shown = progress if pipeline.layout.owns_outputs or not isinstance(progress, bool) else False
    reporter, owned = as_reporter(shown)
    try:
        prompt = _enhanced(request.prompt, prompt_enhancer, stages)
        with stages.stage("text_encode", "text_encode"):
            prompts = [prompt, request.negative_prompt] if plan.guided else [prompt]
            text, text_lens = _encoded_text(pipeline, plan, prompts, placement)
        condition = hooks.encode_condition(pipeline, plan, stages.stage)
        reused: list[int] = []
        with stages.stage("denoise", "denoise"):
            conditioning = hooks.conditioning(pipeline, plan, text, text_lens, condition, noise)
            final = denoise(
                noise,
                plan.steps,
                hooks.scheduler(pipeline, request),
                conditioning,
                _models(pipeline, plan, placement),
                options=plan.options,
                progress=reporter,
                fence=StepFence(pipeline.device, ahead=_steps_ahead(placement)),
                reused=reused,
            )
            if isinstance(placement, OffloadPlacement):
                placement.park_all()
        final = hooks.unpack(pipeline, plan, final)
        with stages.stage("decode"):
            reporter.stage("decode", 1)
            with stages.peaks.stage("decode"), using(placement, "vae"):
                frames = pipeline.decode(final, mode=plan.memory.decode)
            reporter.advance()
    finally:
        if owned:
            reporter.close()
    stages.timings["total"] = time.perf_counter() - started
    frames.flags.writeable = False
    return RunOutput(
        frames=frames,
        latents=final.detach().to("cpu", torch.float32),
        timings=stages.timings,
        memory=dict(stages.peaks.gib),
        reused=tuple(reused),
        lora_report=lora_report,
        prompt=prompt,
        prompt_original=None if prompt_enhancer is None else request.prompt,
    )


def _encoded_text(pipeline: Any, plan: GenerationPlan, prompts: list[str], placement: Placement) -> Any:
    """The family's encode_text of `prompts` on the rank that holds the text encoder; each other rank of
    the world gets that rank's exact output (mmgen.parallel.share.from_first_rank)."""

    def encode() -> Any:
        with using(placement, "text_encoder"):
            stream = placement.text_stream if isinstance(placement, OffloadPlacement) else None
            return pipeline.hooks.encode_text(pipeline, plan, prompts, stream)

    return from_first_rank(encode, pipeline.layout)


def _steps_ahead(placement: Any) -> int:
    """How many steps the host may queue ahead of the device (pipelines.devices.StepFence): one with the
    weights resident; none while an offload moves weights between steps (a move queued a step early
    would have to be proven safe against the step still running: not worth it where copies dominate)."""
    offloaded = isinstance(placement, OffloadPlacement) and placement.offload != "none"
    return 0 if offloaded else 1


def _enhanced(prompt: str, enhancer: Callable[[str], str] | None, stages: _Stages) -> str:
    """The prompt the text encoder gets: the caller's, or the enhancer's rewrite of it (timed)."""
    if enhancer is None:
        return prompt
    tick = time.perf_counter()
    enhanced = enhancer(prompt)
    if not isinstance(enhanced, str):
        raise ValidationError(f"prompt_enhancer returned {type(enhanced).__name__}, expected str")
    stages.timings["prompt_enhance"] = time.perf_counter() - tick
    return enhanced


def _models(pipeline: Any, plan: GenerationPlan, placement: Placement) -> DenoiseModels:
    """The loop's models: the experts, the plan's attention impl and settings (with the placement's
    stream), the family's model call and guidance."""
    stream = placement.stream if isinstance(placement, OffloadPlacement) else None
    return DenoiseModels(
        experts=pipeline.experts,
        attention=plan.attention,
        layout=pipeline.layout,
        placement=placement,
        dtype=pipeline.dtype,
        settings=dataclasses.replace(plan.settings, block_stream=stream),
        call=pipeline.hooks.call,
        guide=pipeline.hooks.guide,
    )


def using(placement: Placement, name: str) -> Any:
    """`name` ('text_encoder' or 'vae') on the device while it runs (offload), else nothing to do."""
    if isinstance(placement, OffloadPlacement):
        return placement.using(name)
    return contextlib.nullcontext()
