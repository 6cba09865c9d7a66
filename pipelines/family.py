"""What a model family supplies to the one prepare -> run -> record (DESIGN.md, "Model families").

Every family's request goes through the same three steps over the same plan type: `pipelines.plan.
prepare` (request + pipeline -> a frozen GenerationPlan), `pipelines.run.run` (noise, LoRAs, placement,
text, conditioning, the one denoise loop of pipelines.denoise, decode; timed per stage) and
`pipelines.record.record` (the GenerationResult). Those steps never name a family: where families
differ they call the pipeline's `hooks`, an object with the methods of `FamilyHooks` below. A hook
takes the pipeline (what lives across calls: components, placement, layout, LoRA slot) and the
request or plan; it keeps no state of its own between calls.

What stays shared and is not a hook: the request value and its checks, the accel/lossy resolution,
the attention impl (`pipeline.attention_for`), the LoRA slot (`pipeline.loras.use(pipeline.experts)`),
the weights' placement (`pipeline.arrange(plan)`), stage timing and memory peaks, the denoise loop's
branch logic (batched or sequential CFG, CFG parallel, CFG truncation, step cache, placement per
step), the VAE decode (`pipeline.decode`: the VAE's latents_mean/std, diffusers' uint8 conversion),
identity hashes, fingerprint and the common recorded args.

The loop's view of a request (`LoopConditioning`): built once per request by the `conditioning` hook
and passed to every model call. It is the request's own state (DESIGN.md, "Caches live in the
request's own state, created per call"): a family whose model keeps per-request values across steps
(a KV cache of a text/condition prefix that does not change across steps) creates it there, and its
`call` hook fills it on the first step and reads it after; nothing is stored on the pipeline, the
model or a module.

Wan: pipelines.wan_family.WanHooks. Qwen-Image / -Edit: pipelines.qwen_image_family.QwenImageHooks /
QwenImageEditHooks. Qwen-Image-2.1: pipelines.qwen_image21_family.QwenImage21Hooks. A complete minimal
family written against these hooks alone: tests/test_family_hooks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mmgen.models.settings import ExecutionSettings
from mmgen.placement.policy import MemoryPlan
from pipelines.fp8_choice import Fp8Choice

if TYPE_CHECKING:  # annotations only: the shared steps import this module, not the other way round
    from pipelines.denoise import DenoiseModels, StepPlan
    from pipelines.plan import GenerationPlan
    from pipelines.request import GenerationRequest
    from pipelines.run import RunOutput
    from pipelines.step_cache import ResolvedAccel

# stage(name, peak=None): a context manager that times one run stage (and records its memory peak
# under `peak`); run passes its own, so a family's conditioning parts are timed like the rest.
Stage = Callable[..., AbstractContextManager[None]]


@dataclass(frozen=True)
class Decisions:
    """What prepare decides about memory and kernels for one request (GenerationPlan's fields of them):
    the memory plan, what runs in FP8 (with the preset parts skipped and why), and the
    ExecutionSettings every model call gets (run adds the placement's block stream)."""

    memory: MemoryPlan = MemoryPlan()
    fp8: Fp8Choice = Fp8Choice()
    settings: ExecutionSettings = ExecutionSettings()


class Branch(Protocol):
    """What the model attends to for one or more CFG branches stacked along the batch (the family's
    own fields: text, attention metadata or layout, ...)."""

    @property
    def batch(self) -> int: ...


class LoopConditioning(Protocol):
    """A request's conditioning as the one denoise loop (pipelines.denoise) uses it.

    both: every branch the request runs, stacked (cond first, then uncond when guided); halves: the
    same one branch each (sequential CFG, CFG parallel, CFG truncation), () unguided.
    """

    both: Any
    halves: tuple[Any, ...]

    @property
    def guided(self) -> bool: ...

    def model_input(self, latents: torch.Tensor) -> torch.Tensor:
        """The loop's latents -> what the model call gets (before the cast to the model dtype)."""
        ...

    def finalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The loop's final latents -> the latents the family unpacks and decodes."""
        ...


class FamilyHooks(Protocol):
    """Where one model family differs, as methods; pipelines.plan / run / record call nothing else of it.

    Shapes: "loop latents" are the family's own layout, float32 or the model dtype as the family
    steps them (Wan [1, C, F', H', W'] float32; Qwen-Image packed [1, N, 4C] in the model dtype);
    `unpack` turns them into the [1, C, F', H', W'] the VAE decodes and result.latents holds.
    """

    # -- prepare (pipelines.plan) --

    def resolve(
        self, pipeline: Any, request: GenerationRequest, *, seeded: bool
    ) -> tuple[GenerationRequest, str | None]:
        """The request with this model's defaults filled in (a fresh seed when `seeded` and none was
        given), after every model-dependent check and refusal (ValidationError naming the field);
        and the size rule (how height/width came from an input, or None). Also the server's
        check_request (seeded=False): no weights run, nothing is drawn."""
        ...

    def decide(
        self, pipeline: Any, request: GenerationRequest, lossy: ResolvedAccel, attention: Any
    ) -> Decisions:
        """Memory plan, FP8 choice and execution settings for the resolved request (the accel preset
        resolved in `lossy`; `attention` the AttentionImpl the request runs)."""
        ...

    def scheduler(self, pipeline: Any, request: GenerationRequest) -> Any:
        """A fresh scheduler for this request, its timesteps set and begin index 0 (schedule, shift,
        preset). Called by prepare (for the steps) and by run (the one that steps the latents)."""
        ...

    def steps(self, pipeline: Any, request: GenerationRequest, scheduler: Any) -> tuple[StepPlan, ...]:
        """Per timestep of `scheduler`: the expert that runs it and its guidance scale."""
        ...

    # -- run (pipelines.run) --

    def initial_latents(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        generator: torch.Generator | None,
        latents: torch.Tensor | None,
    ) -> torch.Tensor:
        """The loop's starting latents on the device: the caller's `latents` (checked; packed if the
        family packs), else drawn from the CPU `generator`, else from a generator seeded with
        plan.request.seed (same seed => same noise on any device)."""
        ...

    def encode_text(
        self, pipeline: Any, plan: GenerationPlan, prompts: list[str], text_stream: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts ([prompt] or [prompt, negative_prompt]) -> (text [B, L, D] on the device, token
        counts int64 [B]). text_stream: the layer placement's stream for the text encoder, or None.
        Runs with the text encoder placed on the device. run passes `text` on to `conditioning` only,
        so a family whose text is more than states may return its own value there (Qwen-Image-2.1: a
        PromptBatch with the image-slot masks its block-causal layout needs); it may read the plan's
        input image itself when its text encoder sees the image (Qwen3-VL)."""
        ...

    def encode_condition(self, pipeline: Any, plan: GenerationPlan, stage: Stage) -> Any:
        """What the request conditions on besides text (input image latents, a control video, ...),
        each part encoded inside `stage(name)` so it is timed; None when there is nothing."""
        ...

    def conditioning(
        self,
        pipeline: Any,
        plan: GenerationPlan,
        text: torch.Tensor,
        text_lens: torch.Tensor,
        condition: Any,
        latents: torch.Tensor,
    ) -> LoopConditioning:
        """The loop's conditioning, built once per request (attention metadata / layouts of every
        branch; per-request caches the model call fills). latents: the loop's starting latents."""
        ...

    def call(
        self,
        model: Any,
        x: torch.Tensor,
        step: StepPlan,
        branch: Any,
        conditioning: LoopConditioning,
        models: DenoiseModels,
    ) -> torch.Tensor:
        """One model call: x (model_input of the latents, model dtype, batch 1) for `branch.batch`
        rows -> the prediction [branch.batch, ...] in the loop latents' layout. models: the experts,
        the attention impl, the parallel layout, the execution settings (block stream included)."""
        ...

    def guide(self, outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
        """(cond,) -> cond; (cond, uncond) -> the guided prediction at `scale`."""
        ...

    def unpack(self, pipeline: Any, plan: GenerationPlan, latents: torch.Tensor) -> torch.Tensor:
        """Final loop latents -> [1, C, F', H', W'] as the VAE decodes them (and result.latents)."""
        ...

    # -- record (pipelines.record) --

    def attention_providers(self, pipeline: Any, plan: GenerationPlan) -> dict[str, str]:
        """Per DiT attention site, the kernel provider it ran ('transformer.self_attn': 'flash:fa3')."""
        ...

    def recorded_args(self, pipeline: Any, plan: GenerationPlan, output: RunOutput) -> dict[str, Any]:
        """This family's part of result.args: 'variant', the request fields it records, and what only
        it decided (JSON-ready). record adds the shared ones (pipeline, model, prompt, noise, dtypes,
        device, fps, defaults, image, memory plan, lossy settings, LoRAs)."""
        ...
