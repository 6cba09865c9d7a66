"""The one denoise loop every family runs (Wan T2V, T2I, I2V, TI2V, VACE, Wan2.2's two experts; Qwen-Image).

A family supplies its model call and its guidance formula (DenoiseModels.call / .guide, from its
hooks: pipelines.family.FamilyHooks) and its conditioning (pipelines.family.LoopConditioning); the
loop's branch logic below is shared. The Wan DiT's call (`dit_call`) and conditioning
(`Conditioning`, `TextBranch`) are the defaults. A variant is data, never a copied loop (DESIGN.md,
"Model variants are data"):
- `StepPlan`s say, per scheduler timestep, which expert transformer runs and with which guidance
  scale (Wan2.2: `transformer` for t >= boundary, `transformer_2` below; Wan2.1: always expert 0);
- a `Conditioning` says what the model call gets besides the noisy latents: the text of each CFG
  branch with its attention metadata (built once per request), optional image embeddings (Wan2.1
  I2V), latents concatenated along channels (I2V), or a first-frame condition blended into the
  latents with per-token timesteps (Wan2.2 TI2V, diffusers' `expand_timesteps`), or VACE's control
  context (read by the transformer's VACE blocks; its reference frames dropped at the end);
- `DenoiseOptions` says how guided steps run: both CFG branches as one batch-2 call (the default,
  fastest when memory allows) or one after the other (less activation memory; same numbers up to
  GEMM rounding), and the lossy accelerations (off by default; pipelines.step_cache): step caching
  (reuse a branch's model output when the timestep signal says the step changes little) and CFG
  truncation (the unconditional branch only for a leading fraction of the steps);
- the parallel layout and the placement are values passed in: the layout goes to every model call
  (sequence parallel) and splits the CFG branches across ranks (CFG parallel); the placement is told
  before each step which expert runs now and which runs next, so it can move or prefetch weights.

Numerically one step is diffusers' WanPipeline / WanImageToVideoPipeline step: the same model input,
timestep, guidance formula `uncond + s * (cond - uncond)` and scheduler call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from mmgen.attention.impls import AttentionImpl
from mmgen.attention.metadata import DiTAttention
from mmgen.errors import ValidationError
from mmgen.models.settings import ExecutionSettings
from mmgen.models.wan import WanDiT
from mmgen.parallel.layout import ParallelLayout
from mmgen.progress import ProgressReporter
from pipelines.devices import StepFence
from pipelines.step_cache import (
    BranchCache,
    check_cfg_truncation,
    check_step_cache,
    guided_steps,
    reuse_schedule,
    time_signal,
)

CFG_MODES = ("batch", "sequential")


@dataclass(frozen=True)
class StepPlan:
    """One denoising step: its index, the scheduler timestep (0-dim tensor), the expert and guidance."""

    index: int
    timestep: torch.Tensor
    expert: int
    guidance_scale: float


def plan_steps(
    timesteps: torch.Tensor, guidance_scales: Sequence[float], boundary_timestep: float | None = None
) -> tuple[StepPlan, ...]:
    """Assign every timestep its expert: 0 when there is no boundary or t >= boundary, else 1.

    guidance_scales: one per expert (Wan2.2 may guide its low-noise expert differently).
    """
    experts = 1 if boundary_timestep is None else 2
    if len(guidance_scales) != experts:
        raise ValidationError(
            f"{experts} expert(s) need {experts} guidance scale(s), got {len(guidance_scales)}"
        )
    plans = []
    for index, t in enumerate(timesteps):
        expert = 0 if boundary_timestep is None or float(t) >= boundary_timestep else 1
        plans.append(StepPlan(index, t, expert, float(guidance_scales[expert])))
    return tuple(plans)


@dataclass(frozen=True)
class TextBranch:
    """What the model attends to for one or more CFG branches, stacked along the batch.

    text [B, L, text_dim] in the model dtype; metadata built for exactly this batch; image_embeds
    [B, N, image_dim] or None.
    """

    text: torch.Tensor
    metadata: DiTAttention
    image_embeds: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.text.shape[0]


class BranchedConditioning:
    """What the loop's conditionings share (pipelines.family.LoopConditioning): guided when the
    request runs two halves (cond, uncond); the loop's latents go to the model and to the decode as
    they are unless a family's conditioning overrides model_input / finalize."""

    halves: tuple[Any, ...]

    @property
    def guided(self) -> bool:
        return len(self.halves) == 2

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def finalize(self, latents: torch.Tensor) -> torch.Tensor:
        return latents


@dataclass(frozen=True)
class Conditioning(BranchedConditioning):
    """Everything a request conditions on, built once before the loop.

    `both`: the branches the request runs, stacked (cond first, then uncond when guided). `halves`:
    the same, one TextBranch per branch (for sequential and CFG-parallel steps), or () unguided.
    `concat`: latents [1, C_c, F', H', W'] concatenated to the noisy latents along channels (I2V).
    `first_frame` [1, C, F', H', W'] and `first_frame_mask` [1, 1, F', H', W'] (TI2V): the model input
    is mask * latents + (1 - mask) * first_frame, and each token's timestep is mask * t.
    `control` [1, C_v, R + F', H', W'] (Wan VACE): the control context every model call reads, its
    hints scaled by `control_scale`; the control tokens lie on the latents' grid and attend to the
    same text, so each branch's metadata serves them too. `references`: the R leading reference
    frames of the latents, dropped by finalize.
    """

    both: TextBranch
    halves: tuple[TextBranch, ...] = ()
    concat: torch.Tensor | None = None
    first_frame: torch.Tensor | None = None
    first_frame_mask: torch.Tensor | None = None
    control: torch.Tensor | None = None
    control_scale: float | tuple[float, ...] = 1.0  # one for every VACE block, or one per block
    references: int = 0

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """float32 latents [1, C, F', H', W'] -> what the DiT gets (before the dtype cast)."""
        if self.first_frame is not None:
            latents = (1 - self.first_frame_mask) * self.first_frame + self.first_frame_mask * latents
        if self.concat is not None:
            latents = torch.cat([latents, self.concat], dim=1)
        return latents

    def timesteps(self, t: torch.Tensor, batch: int, patch_size: tuple[int, int, int]) -> torch.Tensor:
        """The DiT's timestep input: [batch] float32, or [batch, S] per token with a first-frame mask."""
        if self.first_frame_mask is None:
            return t.to(torch.float32).expand(batch)
        pt, ph, pw = patch_size
        per_token = self.first_frame_mask[0, 0, ::pt, ::ph, ::pw].flatten() * t.to(torch.float32)
        return per_token.unsqueeze(0).expand(batch, -1)

    def finalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The latents to decode: the first-frame condition put back where the mask keeps it; VACE's
        reference frames dropped."""
        latents = latents[:, :, self.references :]
        if self.first_frame is None:
            return latents
        return (1 - self.first_frame_mask) * self.first_frame + self.first_frame_mask * latents


@dataclass(frozen=True)
class DenoiseOptions:
    """How steps run. cfg: 'batch' (one batch-2 call) or 'sequential' (two batch-1 calls).

    Lossy, off (None) by default (pipelines.step_cache): step_cache = the reuse threshold on the
    accumulated timestep-signal change (0 = never reuse); cfg_truncation = the fraction of the
    steps, in (0, 1], that keep both CFG branches (1.0 = all).
    """

    cfg: Literal["batch", "sequential"] = "batch"
    step_cache: float | None = None
    cfg_truncation: float | None = None

    def __post_init__(self) -> None:
        if self.cfg not in CFG_MODES:
            raise ValidationError(f"cfg mode {self.cfg!r}: allowed values are {', '.join(CFG_MODES)}")
        check_step_cache(self.step_cache)
        check_cfg_truncation(self.cfg_truncation)


class Placement(Protocol):
    """Where weights live during the loop; told before each step which expert runs now and next."""

    def before_step(self, step: StepPlan, next_step: StepPlan | None) -> None: ...


class ResidentPlacement:
    """Everything stays where it was loaded (the default): nothing to do between steps."""

    def before_step(self, step: StepPlan, next_step: StepPlan | None) -> None:
        return None


def denoise(
    latents: torch.Tensor,
    steps: Sequence[StepPlan],
    scheduler: Any,
    conditioning: Conditioning,
    models: DenoiseModels,
    *,
    options: DenoiseOptions = DenoiseOptions(),
    progress: ProgressReporter,
    fence: StepFence | None = None,
    reused: list[int] | None = None,
) -> torch.Tensor:
    """float32 noise [1, C, F', H', W'] -> float32 final latents (first-frame condition restored).

    `scheduler` is fresh for this request with its timesteps set (steps[i].timestep is its i-th).
    `fence` (pipelines.devices.StepFence) is told after every step's launches and says how many steps
    have finished, which progress then reports: finished work, not queued launches (None: a CPU
    fence, each step reported once its launches return). It is drained before this returns.
    `reused`: the caller's list; the index of every step that reused the step cache is appended.
    """
    progress.stage("denoise", len(steps))
    fence = StepFence("cpu") if fence is None else fence
    keep_cfg = guided_steps(options.cfg_truncation, len(steps))
    reuse = step_reuse(steps, models, options)
    cache = BranchCache()  # this call's own: nothing carries to the next request
    for position, step in enumerate(steps):
        upcoming = steps[position + 1] if position + 1 < len(steps) else None
        models.placement.before_step(step, upcoming)
        guided = conditioning.guided and position < keep_cfg
        outputs = cache.load(step.expert, 2 if guided else 1) if reuse[position] else None
        if outputs is None:
            outputs = branch_outputs(latents, step, conditioning, models, options, guided=guided)
            if options.step_cache is not None:
                cache.store(step.expert, outputs)
        elif reused is not None:
            reused.append(step.index)
        prediction = models.guide(outputs, step.guidance_scale)
        latents = scheduler.step(prediction, step.timestep, latents, return_dict=False)[0]
        _report_finished(progress, fence.queued())
    _report_finished(progress, fence.drain())
    return conditioning.finalize(latents)


def _report_finished(progress: ProgressReporter, steps: int) -> None:
    """Progress for the steps the fence says have finished; none, no report (a reporter may do work per
    report: a group's leader broadcasts its stop decision, the server observes a step's seconds)."""
    if steps:
        progress.advance(steps)


def step_reuse(steps: Sequence[StepPlan], models: DenoiseModels, options: DenoiseOptions) -> tuple[bool, ...]:
    """Per step, whether it reuses the step cache (all False with step caching off)."""
    if options.step_cache is None:
        return (False,) * len(steps)
    signals = [time_signal(models.experts[step.expert], step.timestep) for step in steps]
    return reuse_schedule(signals, [step.expert for step in steps], options.step_cache)


def predict_noise(
    latents: torch.Tensor,
    step: StepPlan,
    conditioning: Conditioning,
    models: DenoiseModels,
    options: DenoiseOptions,
) -> torch.Tensor:
    """The guided noise prediction [1, C_out, F', H', W'] of one step (the model's dtype)."""
    outputs = branch_outputs(latents, step, conditioning, models, options, guided=conditioning.guided)
    return models.guide(outputs, step.guidance_scale)


def guide(outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
    """(cond,) -> cond; (cond, uncond) -> uncond + scale * (cond - uncond), diffusers' formula."""
    if len(outputs) == 1:
        return outputs[0]
    cond, uncond = outputs
    return uncond + scale * (cond - uncond)


def branch_outputs(
    latents: torch.Tensor,
    step: StepPlan,
    conditioning: Conditioning,
    models: DenoiseModels,
    options: DenoiseOptions,
    *,
    guided: bool,
) -> tuple[torch.Tensor, ...]:
    """The model outputs of one step, each [1, C_out, F', H', W']: (cond, uncond) when guided, else (cond,).

    guided=False on a guided conditioning runs the conditional branch alone (CFG truncation).
    """
    model = models.experts[step.expert]
    x = conditioning.model_input(latents).to(models.dtype)
    if not conditioning.guided:
        return (models.call(model, x, step, conditioning.both, conditioning, models),)
    if not guided:
        # Every rank (CFG parallel too) runs the conditional branch: there is nothing to exchange.
        return (models.call(model, x, step, conditioning.halves[0], conditioning, models),)
    if models.layout.cfg_degree == 2:
        # CFG parallel: this rank runs its own branch; the two predictions meet once per step.
        mine = models.call(model, x, step, conditioning.halves[models.layout.cfg_rank], conditioning, models)
        return _gather_cfg(mine, models.layout)
    if options.cfg == "sequential":
        return tuple(models.call(model, x, step, half, conditioning, models) for half in conditioning.halves)
    cond, uncond = models.call(model, x, step, conditioning.both, conditioning, models).chunk(2)
    return cond, uncond


def dit_call(
    model: WanDiT,
    x: torch.Tensor,
    step: StepPlan,
    branch: TextBranch,
    conditioning: Conditioning,
    models: DenoiseModels,
) -> torch.Tensor:
    """One Wan DiT call for `branch` (its text and metadata; the conditioning's timesteps, image
    embeddings, VACE control) -> the prediction [branch.batch, C_out, F', H', W']."""
    batch = branch.batch
    timestep = conditioning.timesteps(step.timestep.to(x.device), batch, model.config.patch_size)
    extra: dict[str, Any] = {}
    if branch.image_embeds is not None:
        extra["image_embeds"] = branch.image_embeds
    if conditioning.control is not None:  # one control context for every branch of the batch
        extra["control"] = conditioning.control.expand(batch, -1, -1, -1, -1)
        extra["control_scale"] = conditioning.control_scale
        extra["control_metadata"] = branch.metadata
    if not models.layout.is_single:
        extra["parallel"] = models.layout
    return model(
        x.expand(batch, -1, -1, -1, -1),
        timestep,
        branch.text,
        attention=models.attention,
        metadata=branch.metadata,
        settings=models.settings,
        **extra,
    )


@dataclass(frozen=True)
class DenoiseModels:
    """The experts (index = StepPlan.expert), the attention impl, the layout, the placement and the
    execution settings every model call gets (mmgen.models.settings); `call` runs one model call and
    `guide` joins a guided step's branch outputs: the family's hooks (pipelines.family.FamilyHooks),
    by default the Wan DiT's call and diffusers' CFG formula."""

    experts: tuple[Any, ...]
    attention: AttentionImpl
    layout: ParallelLayout
    placement: Placement
    dtype: torch.dtype
    settings: ExecutionSettings = ExecutionSettings()
    call: Callable[..., torch.Tensor] = dit_call
    guide: Callable[[Sequence[torch.Tensor], float], torch.Tensor] = guide


def _gather_cfg(mine: torch.Tensor, layout: ParallelLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Both CFG branches' predictions on every rank of the CFG group: (cond, uncond)."""
    parts = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(parts, mine.contiguous(), group=layout.cfg_group)
    return parts[0], parts[1]


def split_branches(both: TextBranch, build_metadata: Callable[[int], DiTAttention]) -> tuple[TextBranch, ...]:
    """One TextBranch per row of a stacked `both` (cond, uncond), each with metadata for its row.

    build_metadata(row) returns the DiTAttention of that row alone (text lengths differ per prompt).
    """
    return tuple(
        replace(
            both,
            text=both.text[row : row + 1],
            metadata=build_metadata(row),
            image_embeds=None if both.image_embeds is None else both.image_embeds[row : row + 1],
        )
        for row in range(both.batch)
    )
