"""Named generation presets: the step count, guidance and scheduler a distilled model is run with.

A preset belongs to one model family (`Preset.family`): a request names it by name alone (checked
here, before any model loads), and the loaded pipeline refuses a preset of another family with one
line listing its own (`check_family`).

Wan, `distill-4step`: how the step- and CFG-distilled Wan LoRAs (lightx2v's Wan2.1/Wan2.2 "4step"
distillation LoRAs, e.g. wan2.1_t2v_14b_lora_rank64_lightx2v_4step) are run by their authors'
LightX2V configs: 4 steps, no CFG (guidance 1, so one batch-1 model call per step), flow-matching
Euler steps (x <- x + (sigma_next - sigma) * v, ending at sigma 0) on the fixed denoising step list
[1000, 750, 500, 250] of 1000 train timesteps, i.e. sigmas [1, 0.75, 0.5, 0.25] warped by shift 5
(sigma' = 5s / (1 + 4s)): timesteps 1000, 937.5, 833.3, 625. diffusers' FlowMatchEulerDiscrete
scheduler with shift 5 and these sigmas computes exactly that schedule, so that is what runs.

Qwen-Image, `lightning-8step` / `lightning-4step`: the schedule lightx2v publishes for its
Qwen-Image-Lightning distillation LoRAs (Qwen-Image-Lightning-8steps-V1.x/V2.0 and -4steps-*, the
model card's and ModelTC/Qwen-Image-Lightning's generate_with_diffusers.py): diffusers'
FlowMatchEulerDiscreteScheduler with use_dynamic_shifting, time_shift_type "exponential" and
base_shift = max_shift = ln 3 ("we use shift=3 in distillation"), so the dynamic shift mu is ln 3 at
every image size; shift_terminal off; true CFG scale 1.0 (CFG off, one call per step); 8 or 4 steps
on QwenImagePipeline's sigmas linspace(1, 1/steps, steps). Each sigma s becomes 3s / (1 + 2s).
The LoRA itself is the user's file (`--lora PATH`): a preset fixes the schedule, not the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from mmgen.errors import ValidationError

FAMILIES = MappingProxyType({"wan": "Wan", "qwen-image": "Qwen-Image"})


@dataclass(frozen=True)
class Preset:
    """Fixed request values and the scheduler: diffusers' FlowMatchEulerDiscreteScheduler made from
    `scheduler_config`, its timesteps set from `sigmas` (and mu, for a dynamic-shift config)."""

    name: str
    family: str
    num_inference_steps: int
    guidance_scale: float
    scheduler_config: Mapping[str, Any]
    sigmas: tuple[float, ...]
    source: str

    def __post_init__(self) -> None:
        assert self.family in FAMILIES, self.family
        assert len(self.sigmas) == self.num_inference_steps, self.name

    @property
    def shift(self) -> float:
        return float(self.scheduler_config.get("shift", 1.0))

    def scheduler(self, device: Any, mu: float | None = None) -> Any:
        """A FlowMatchEulerDiscreteScheduler with this preset's timesteps set on `device`.

        mu: the dynamic shift, needed when the config has use_dynamic_shifting (the pipeline computes
        it from this config and the image size, as diffusers' pipelines do)."""
        # diffusers takes ~2 s to import: kept off the request checks' path
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(dict(self.scheduler_config))
        scheduler.set_timesteps(sigmas=list(self.sigmas), device=device, mu=mu)
        return scheduler

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "scheduler": "FlowMatchEulerDiscreteScheduler",
            "shift": self.shift,
            "scheduler_config": dict(self.scheduler_config),
            "sigmas": list(self.sigmas),
            "source": self.source,
        }


# The Qwen-Image-Lightning scheduler config, as its authors give it to diffusers.
LIGHTNING_SCHEDULER = MappingProxyType(
    {
        "base_image_seq_len": 256,
        "base_shift": math.log(3),
        "invert_sigmas": False,
        "max_image_seq_len": 8192,
        "max_shift": math.log(3),
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": None,
        "stochastic_sampling": False,
        "time_shift_type": "exponential",
        "use_beta_sigmas": False,
        "use_dynamic_shifting": True,
        "use_exponential_sigmas": False,
        "use_karras_sigmas": False,
    }
)


def _lightning(steps: int) -> Preset:
    return Preset(
        name=f"lightning-{steps}step",
        family="qwen-image",
        num_inference_steps=steps,
        guidance_scale=1.0,
        scheduler_config=LIGHTNING_SCHEDULER,
        # QwenImagePipeline's sigmas for `steps` steps (float64, as numpy makes them)
        sigmas=tuple(np.linspace(1.0, 1 / steps, steps).tolist()),
        source=f"lightx2v Qwen-Image-Lightning-{steps}steps LoRAs (model card / generate_with_diffusers.py): "
        "FlowMatchEulerDiscreteScheduler, dynamic exponential shift with base_shift = max_shift = ln 3, "
        f"shift_terminal None, true_cfg_scale 1.0, {steps} steps",
    )


PRESETS = MappingProxyType(
    {
        "distill-4step": Preset(
            name="distill-4step",
            family="wan",
            num_inference_steps=4,
            guidance_scale=1.0,
            scheduler_config=MappingProxyType({"num_train_timesteps": 1000, "shift": 5.0}),
            sigmas=(1.0, 0.75, 0.5, 0.25),
            source="LightX2V step/CFG distillation (WanStepDistillScheduler): denoising_step_list "
            "[1000, 750, 500, 250], sample_shift 5, enable_cfg false",
        ),
        "lightning-8step": _lightning(8),
        "lightning-4step": _lightning(4),
    }
)


def presets_of(family: str) -> tuple[str, ...]:
    """The names of the presets of model family `family` ('wan' or 'qwen-image')."""
    return tuple(name for name, preset in PRESETS.items() if preset.family == family)


def check_preset(name: Any) -> Preset | None:
    """None -> None; a known name -> its Preset; anything else is an error listing the names."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in PRESETS:
        raise ValidationError(f"preset {name!r}: allowed values are {', '.join(PRESETS)}")
    return PRESETS[name]


def check_family(name: Any, family: str) -> Preset | None:
    """check_preset, then: the preset must be of the loaded model's `family`, else one line listing its own."""
    preset = check_preset(name)
    if preset is not None and preset.family != family:
        own = ", ".join(presets_of(family)) or "none"
        raise ValidationError(
            f"preset = {name!r}: a {FAMILIES[preset.family]} preset; this {FAMILIES[family]} model takes "
            f"the presets {own}"
        )
    return preset


def preset_value(preset: Preset | None, field: str, given: Any) -> Any:
    """The value of request field `field`: the preset's when given is None; a conflicting value is an error."""
    if preset is None:
        return given
    fixed = getattr(preset, field)
    if given is not None and given != fixed:
        raise ValidationError(
            f"{field} = {given!r} conflicts with preset {preset.name!r}, which sets {fixed!r}"
        )
    return fixed
