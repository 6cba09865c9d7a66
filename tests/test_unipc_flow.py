"""mmgen's flow UniPC (mmgen.schedulers.unipc_flow) against diffusers' UniPCMultistepScheduler.

The same schedule and the same update: both compute the same elementwise ops on the same tensors in
the same order (no GEMM: the only solve is a <= 3x3 system of the same shape on both sides), so the
samples are compared exactly; the embedded default model's frames SHA depends on it. The configs
outside the written subset are refused by `fits`, and the loader gives those to diffusers.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.loading.diffusers_dir import load_scheduler
from mmgen.schedulers.unipc_flow import CLASS_NAME, FlowUniPCScheduler, fits

diffusers = pytest.importorskip("diffusers")

WAN = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
VARIANTS = [
    {},
    {"solver_order": 1},
    {"solver_order": 3},
    {"flow_shift": 5.0, "final_sigmas_type": "sigma_min"},
    {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
    {"disable_corrector": [1, 2]},
    {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
]


def run(scheduler, steps: int, begin: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` steps on seeded flow predictions: (timesteps, final sample [1, 4, 3, 5, 5])."""
    scheduler.set_timesteps(steps)
    if begin:
        scheduler.set_begin_index(0)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 3, 5, 5, generator=generator)
    for t in scheduler.timesteps:
        prediction = torch.randn(1, 4, 3, 5, 5, generator=generator)
        sample = scheduler.step(prediction, t, sample, return_dict=False)[0]
    return scheduler.timesteps, sample


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "wan")
@pytest.mark.parametrize("steps", [1, 2, 5, 12])
def test_samples_equal_diffusers_unipc(variant, steps):
    config = dict(diffusers.UniPCMultistepScheduler(**{**WAN, **variant}).config)
    assert fits(config)
    for begin in (True, False):  # the pipelines set the begin index; without it the timestep finds it
        ref_t, ref = run(diffusers.UniPCMultistepScheduler.from_config(config), steps, begin)
        own_t, own = run(FlowUniPCScheduler.from_config(config), steps, begin)
        assert torch.equal(ref_t, own_t)
        assert torch.isfinite(own).all()
        torch.testing.assert_close(own, ref, rtol=0, atol=0)


def test_a_fresh_copy_from_its_config_restarts():
    scheduler = FlowUniPCScheduler.from_config(dict(diffusers.UniPCMultistepScheduler(**WAN).config))
    first = run(scheduler, 4, True)[1]
    again = run(type(scheduler).from_config(scheduler.config), 4, True)[1]
    assert torch.equal(first, again) and scheduler.config.num_train_timesteps == 1000


@pytest.mark.parametrize(
    "other",
    [
        {"use_karras_sigmas": True},
        {"use_dynamic_shifting": True, "time_shift_type": "exponential"},
        {"thresholding": True},
        {"prediction_type": "epsilon", "use_flow_sigmas": False},
        {"shift_terminal": 0.1},
        {"a_future_option": 1},
    ],
)
def test_other_configs_go_to_diffusers(other, tmp_path):
    config = {**dict(diffusers.UniPCMultistepScheduler(**WAN).config), **other}
    assert not fits(config)
    with pytest.raises(ValueError, match="not a flow UniPC config"):
        FlowUniPCScheduler.from_config(config)
    if "a_future_option" in other:
        return
    (tmp_path / "scheduler_config.json").write_text(json.dumps({"_class_name": CLASS_NAME, **config}))
    assert isinstance(load_scheduler(tmp_path), diffusers.UniPCMultistepScheduler)


def test_the_loader_gives_wan_configs_to_mmgen(default_model_dir):
    assert isinstance(load_scheduler(default_model_dir / "scheduler"), FlowUniPCScheduler)
