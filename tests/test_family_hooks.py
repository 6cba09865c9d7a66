"""A family is its hooks: a toy family (a tiny model defined here) runs through the one prepare -> run ->
record (pipelines.pipeline.Pipeline) with nothing but pipelines.family.FamilyHooks written for it.

The toy model has what Qwen-Image-2.1 will have: a prefix (here: the text through one linear layer)
whose values do not change across steps, computed once per request into a cache that lives in the
request's conditioning (DESIGN.md: caches live in the request's own state, created per call). The
reference is the same math written out as a plain loop over diffusers' FlowMatch Euler scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.loading.defaults import GenerationDefaults
from mmgen.lora import LoRASlot
from mmgen.parallel.layout import ParallelLayout
from pipelines.denoise import BranchedConditioning, ResidentPlacement, plan_steps
from pipelines.family import Decisions
from pipelines.pipeline import Pipeline

pytest.importorskip("diffusers")

CHANNELS, TEXT_DIM, GRID, SCALE = 4, 8, 2, 8  # latents [1, C, 1, G, G]; one frame of G * 8 pixels a side
DEFAULTS = GenerationDefaults(
    height=GRID * SCALE, width=GRID * SCALE, num_frames=1, num_inference_steps=3, fps=1
)


class ToyModel(torch.nn.Module):
    """prediction = W x + prefix (+ t * b): the prefix is the text's, the same at every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(CHANNELS, CHANNELS)
        self.text_proj = torch.nn.Linear(TEXT_DIM, CHANNELS)
        self.config = SimpleNamespace(attention_head_dim=8)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj.weight.dtype

    def prefix(self, text: torch.Tensor) -> torch.Tensor:
        """text [B, L, D] -> [B, C, 1, 1, 1]: what the cache holds."""
        return self.text_proj(text.mean(dim=1))[:, :, None, None, None]

    def forward(self, x: torch.Tensor, t: torch.Tensor, prefix: torch.Tensor) -> torch.Tensor:
        moved = self.proj(x.movedim(1, -1)).movedim(-1, 1)
        return moved + prefix + t.view(-1, 1, 1, 1, 1) / 1000


class ToyVAE(torch.nn.Module):
    """Decodes latents [1, C, 1, h, w] to [1, 3, 1, 8h, 8w] in [-1, 1] (the first three channels, tanh,
    each latent pixel an 8 x 8 block)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.config = SimpleNamespace(
            z_dim=CHANNELS, latents_mean=[0.0] * CHANNELS, latents_std=[1.0] * CHANNELS
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    def decode(self, z: torch.Tensor, return_dict: bool = False) -> tuple[torch.Tensor]:
        video = torch.tanh(z[:, :3] * self.scale)
        return (video.repeat_interleave(SCALE, dim=-2).repeat_interleave(SCALE, dim=-1),)


@dataclass
class PrefixCache:
    """The request's own cache: filled by the first model call of a branch, read by the later ones."""

    values: dict[int, torch.Tensor] = field(default_factory=dict)
    fills: int = 0


@dataclass(frozen=True)
class ToyBranch:
    text: torch.Tensor
    index: int

    @property
    def batch(self) -> int:
        return self.text.shape[0]


@dataclass(frozen=True)
class ToyConditioning(BranchedConditioning):
    both: ToyBranch
    halves: tuple[ToyBranch, ...]
    cache: PrefixCache


def encode(prompt: str) -> torch.Tensor:
    """A prompt -> text [1, 3, TEXT_DIM]: a seeded table row per character class (deterministic)."""
    table = torch.randn(3, TEXT_DIM, generator=torch.Generator().manual_seed(len(prompt)))
    return table[None]


class ToyHooks:
    """The toy family: one frame, one expert, plain CFG, a per-request prefix cache."""

    def resolve(self, pipeline: Any, request: Any, *, seeded: bool) -> tuple[Any, str | None]:
        if request.image is not None:
            raise ValidationError("image: the toy family takes no image")
        filled = {k: v for k, v in pipeline.defaults.request_values().items() if getattr(request, k) is None}
        if request.seed is None and seeded:
            filled["seed"] = 1
        return request.with_values(**filled), None

    def decide(self, pipeline: Any, request: Any, lossy: Any, attention: Any) -> Decisions:
        return Decisions()

    def scheduler(self, pipeline: Any, request: Any) -> Any:
        return fresh_scheduler(request.num_inference_steps)

    def steps(self, pipeline: Any, request: Any, scheduler: Any) -> tuple[Any, ...]:
        return plan_steps(scheduler.timesteps, (request.guidance_scale,))

    def initial_latents(self, pipeline: Any, plan: Any, generator: Any, latents: Any) -> torch.Tensor:
        generator = torch.Generator().manual_seed(plan.request.seed) if generator is None else generator
        return torch.randn((1, CHANNELS, 1, GRID, GRID), generator=generator)

    def encode_text(self, pipeline: Any, plan: Any, prompts: list[str], text_stream: Any) -> Any:
        text = torch.cat([encode(prompt) for prompt in prompts])
        return text, torch.full((len(prompts),), text.shape[1])

    def encode_condition(self, pipeline: Any, plan: Any, stage: Any) -> None:
        return None

    def conditioning(self, pipeline: Any, plan: Any, text: Any, text_lens: Any, condition: Any, latents: Any):
        halves = (
            tuple(ToyBranch(text[row : row + 1], row + 1) for row in range(text.shape[0]))
            if text.shape[0] == 2
            else ()
        )
        return ToyConditioning(ToyBranch(text, 0), halves, PrefixCache())

    def call(
        self, model: Any, x: Any, step: Any, branch: Any, conditioning: Any, models: Any
    ) -> torch.Tensor:
        cache = conditioning.cache
        if branch.index not in cache.values:  # the first step: fill the prefix once for this request
            cache.values[branch.index] = model.prefix(branch.text)
            cache.fills += 1
        prefix = cache.values[branch.index]
        return model(x.expand(branch.batch, -1, -1, -1, -1), step.timestep.expand(branch.batch), prefix)

    def guide(self, outputs: Sequence[torch.Tensor], scale: float) -> torch.Tensor:
        return outputs[0] if len(outputs) == 1 else outputs[1] + scale * (outputs[0] - outputs[1])

    def unpack(self, pipeline: Any, plan: Any, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def attention_providers(self, pipeline: Any, plan: Any) -> dict[str, str]:
        return {"toy.prefix": "none"}

    def recorded_args(self, pipeline: Any, plan: Any, output: Any) -> dict[str, Any]:
        return {"variant": "toy", **plan.request.record()}


class ToyPipeline(Pipeline):
    hooks = ToyHooks()

    def __init__(self) -> None:
        self.components = SimpleNamespace(transformer=ToyModel(), vae=ToyVAE(), source=None)
        self._device = torch.device("cpu")
        self.layout = ParallelLayout.single()
        self.loras = LoRASlot()
        self.placement = ResidentPlacement()

    @property
    def defaults(self) -> GenerationDefaults:
        return DEFAULTS

    def arrange(self, plan: Any) -> ResidentPlacement:
        return self.placement


def fresh_scheduler(steps: int) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(steps)
    scheduler.set_begin_index(0)
    return scheduler


def reference(
    model: ToyModel, prompt: str, negative: str, seed: int, steps: int, scale: float
) -> torch.Tensor:
    """The same generation as a plain loop: final latents [1, C, 1, G, G]."""
    latents = torch.randn((1, CHANNELS, 1, GRID, GRID), generator=torch.Generator().manual_seed(seed))
    cond, uncond = model.prefix(encode(prompt)), model.prefix(encode(negative))
    scheduler = fresh_scheduler(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            c, u = model(latents, t[None], cond), model(latents, t[None], uncond)
            latents = scheduler.step(u + scale * (c - u), t, latents, return_dict=False)[0]
    return latents


@pytest.mark.parametrize("cfg", ["batch", "sequential"])
def test_toy_family_runs_the_shared_steps(cfg):
    pipe = ToyPipeline()
    result = pipe("a cat", "blurry", seed=5, guidance_scale=2.5, cfg=cfg, progress=False)
    expected = reference(pipe.transformer, "a cat", "blurry", 5, DEFAULTS.num_inference_steps, 2.5)
    assert torch.allclose(result.latents, expected, atol=1e-6, rtol=0)
    pixels = (torch.tanh(expected[0, :3, 0]) * 0.5 + 0.5).permute(1, 2, 0).numpy() * 255  # [G, G, 3]
    blocks = pixels.repeat(SCALE, axis=0).repeat(SCALE, axis=1)
    assert result.frames.shape == (1, GRID * SCALE, GRID * SCALE, 3)
    assert np.abs(result.frames[0].astype(int) - blocks.round().astype(int)).max() <= 1
    assert result.args["variant"] == "toy" and result.args["seed"] == 5 and result.args["cfg"] == cfg
    assert result.attention_providers == {"toy.prefix": "none"}
    assert set(result.timings) >= {"text_encode", "denoise", "decode", "total"}


def test_prefix_cache_is_the_requests_own():
    """Filled once per branch per request (not per step), and a new request starts empty."""
    pipe = ToyPipeline()
    made: list[ToyConditioning] = []
    hooks = pipe.hooks

    class Watching(ToyHooks):
        def conditioning(self, *args: Any) -> ToyConditioning:
            made.append(hooks.conditioning(*args))
            return made[-1]

    pipe.hooks = Watching()
    first = pipe("a cat", "blurry", seed=5, guidance_scale=2.5, progress=False)
    second = pipe("a cat", "blurry", seed=5, guidance_scale=2.5, progress=False)
    assert [conditioning.cache.fills for conditioning in made] == [1, 1]  # batch CFG: one branch, 3 steps
    assert made[0].cache is not made[1].cache
    assert first.frames_sha256 == second.frames_sha256


def test_refusal_and_check_request_come_from_the_hooks():
    pipe = ToyPipeline()
    with pytest.raises(ValidationError, match="image: the toy family"):
        pipe("a cat", image=np.zeros((8, 8, 3), np.uint8), progress=False)
    checked = pipe.check_request(pipe_request("a cat"))
    assert (checked.height, checked.width, checked.seed) == (GRID * SCALE, GRID * SCALE, None)


def pipe_request(prompt: str) -> Any:
    from pipelines.request import GenerationRequest

    return GenerationRequest.from_call(prompt=prompt)
