"""pipelines.denoise: the one loop every variant runs (expert plan, CFG modes, placement seam)."""

from __future__ import annotations

import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.progress import NullProgress
from pipelines.denoise import DenoiseModels, DenoiseOptions, denoise, plan_steps
from pipelines.wan_t2v import WanT2VPipeline


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


def test_plan_steps_switches_expert_at_the_boundary():
    timesteps = torch.tensor([999.0, 875.0, 750.0, 625.0, 500.0])
    steps = plan_steps(timesteps, (5.0, 3.0), boundary_timestep=700.0)
    assert [s.expert for s in steps] == [0, 0, 0, 1, 1]
    assert [s.guidance_scale for s in steps] == [5.0, 5.0, 5.0, 3.0, 3.0]
    assert [s.index for s in steps] == [0, 1, 2, 3, 4]
    # A timestep equal to the boundary belongs to the high-noise expert (diffusers: t >= boundary).
    assert plan_steps(torch.tensor([700.0]), (5.0, 3.0), 700.0)[0].expert == 0
    assert {s.expert for s in plan_steps(timesteps, (5.0,))} == {0}
    with pytest.raises(ValidationError, match="2 expert"):
        plan_steps(timesteps, (5.0,), boundary_timestep=700.0)


def test_cfg_mode_is_checked():
    with pytest.raises(ValidationError, match="allowed values are batch, sequential"):
        DenoiseOptions(cfg="parallel")


class RecordingPlacement:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []

    def before_step(self, step, next_step) -> None:
        self.calls.append((step.index, None if next_step is None else next_step.index))


def _run(pipe, options: DenoiseOptions, placement) -> torch.Tensor:
    text, lens = pipe.encode_text(["a red circle moves left", ""], 16)
    conditioning = pipe.conditioning(text, lens)
    scheduler = type(pipe.components.scheduler).from_config(pipe.components.scheduler.config)
    scheduler.set_timesteps(3)
    scheduler.set_begin_index(0)
    steps = plan_steps(scheduler.timesteps, (5.0,))
    models = DenoiseModels(
        (pipe.transformer,), pipe.attention_for("auto"), pipe.layout, placement, pipe.dtype
    )
    noise = torch.randn(pipe.latents_shape(32, 48, 5), generator=torch.Generator().manual_seed(3))
    return denoise(noise, steps, scheduler, conditioning, models, options=options, progress=NullProgress())


def test_sequential_cfg_equals_batched_cfg_and_placement_is_told_every_step(pipe):
    placement = RecordingPlacement()
    batched = _run(pipe, DenoiseOptions(cfg="batch"), placement)
    assert placement.calls == [(0, 1), (1, 2), (2, None)]
    sequential = _run(pipe, DenoiseOptions(cfg="sequential"), RecordingPlacement())
    # Batch 2 vs two batch-1 calls: the same math through differently shaped GEMMs.
    torch.testing.assert_close(sequential, batched, atol=1e-4, rtol=1e-4)
