"""pipelines.denoise: the one loop every variant runs (expert plan, CFG modes, placement seam)."""

from __future__ import annotations

import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.progress import NullProgress
from pipelines.denoise import DenoiseModels, DenoiseOptions, denoise, plan_steps
from pipelines.devices import StepFence
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


def _run(pipe, options: DenoiseOptions, placement, progress=None, fence=None) -> torch.Tensor:
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
    progress = NullProgress() if progress is None else progress
    return denoise(
        noise, steps, scheduler, conditioning, models, options=options, progress=progress, fence=fence
    )


def test_sequential_cfg_equals_batched_cfg_and_placement_is_told_every_step(pipe):
    placement = RecordingPlacement()
    batched = _run(pipe, DenoiseOptions(cfg="batch"), placement)
    assert placement.calls == [(0, 1), (1, 2), (2, None)]
    sequential = _run(pipe, DenoiseOptions(cfg="sequential"), RecordingPlacement())
    # Batch 2 vs two batch-1 calls: the same math through differently shaped GEMMs.
    torch.testing.assert_close(sequential, batched, atol=1e-4, rtol=1e-4)


class CountingProgress(NullProgress):
    def __init__(self) -> None:
        self.advances: list[int] = []

    def advance(self, units: int = 1) -> None:
        self.advances.append(units)


class LaggingFence:
    """A StepFence one step behind, as on CUDA with ahead=1: nothing finished after the first step's
    launches, one step after each later one, the last at the drain."""

    def __init__(self) -> None:
        self.queued_calls = 0

    def queued(self) -> int:
        self.queued_calls += 1
        return 0 if self.queued_calls == 1 else 1

    def drain(self) -> int:
        return 1


def test_progress_reports_each_step_once_whatever_the_fence_lags(pipe):
    unfenced, lagging = CountingProgress(), CountingProgress()
    fence = LaggingFence()
    a = _run(pipe, DenoiseOptions(), RecordingPlacement(), unfenced)
    b = _run(pipe, DenoiseOptions(), RecordingPlacement(), lagging, fence)
    assert unfenced.advances == [1, 1, 1]
    assert lagging.advances == [1, 1, 1] and fence.queued_calls == 3
    assert torch.equal(a, b)  # the fence changes when the host waits, never what is computed


def test_step_fence_off_cuda_reports_every_step_at_once():
    fence = StepFence("cpu", ahead=1)
    assert [fence.queued() for _ in range(3)] == [1, 1, 1]
    assert fence.drain() == 0
    with pytest.raises(ValidationError, match="allowed values are 0 and 1"):
        StepFence("cpu", ahead=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_fence_on_cuda_keeps_one_step_queued():
    fence = StepFence("cuda", ahead=1)
    x = torch.randn(2048, 2048, device="cuda")
    finished = []
    for _ in range(4):
        for _ in range(20):  # a step long enough to be unfinished when its launches return
            x = (x @ x).tanh()
        finished.append(fence.queued())
    assert finished == [0, 1, 1, 1]
    assert fence.drain() == 1 and fence.drain() == 0
    immediate = StepFence("cuda", ahead=0)
    assert immediate.queued() == 1 and immediate.drain() == 0
