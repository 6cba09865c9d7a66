"""Named generation presets: the step count, guidance and scheduler a model variant is run with.

`distill-4step` is how the step- and CFG-distilled Wan LoRAs (lightx2v's Wan2.1/Wan2.2 "4step"
distillation LoRAs, e.g. wan2.1_t2v_14b_lora_rank64_lightx2v_4step) are run by their authors'
LightX2V configs: 4 steps, no CFG (guidance 1, so one batch-1 model call per step), flow-matching
Euler steps (x <- x + (sigma_next - sigma) * v, ending at sigma 0) on the fixed denoising step list
[1000, 750, 500, 250] of 1000 train timesteps, i.e. sigmas [1, 0.75, 0.5, 0.25] warped by shift 5
(sigma' = 5s / (1 + 4s)): timesteps 1000, 937.5, 833.3, 625. diffusers' FlowMatchEulerDiscrete
scheduler with shift 5 and these sigmas computes exactly that schedule, so that is what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmgen.errors import ValidationError


@dataclass(frozen=True)
class Preset:
    """Fixed request values and the scheduler (diffusers FlowMatchEulerDiscrete, `shift`, `sigmas`)."""

    name: str
    num_inference_steps: int
    guidance_scale: float
    shift: float
    sigmas: tuple[float, ...]
    source: str

    def scheduler(self, device: Any) -> Any:
        """A FlowMatchEulerDiscreteScheduler with this preset's timesteps set on `device`."""
        # diffusers takes ~2 s to import: kept off the request checks' path
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=self.shift)
        scheduler.set_timesteps(sigmas=list(self.sigmas), device=device)
        return scheduler

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "scheduler": "FlowMatchEulerDiscreteScheduler",
            "shift": self.shift,
            "sigmas": list(self.sigmas),
            "source": self.source,
        }


PRESETS = MappingProxyType(
    {
        "distill-4step": Preset(
            name="distill-4step",
            num_inference_steps=4,
            guidance_scale=1.0,
            shift=5.0,
            sigmas=(1.0, 0.75, 0.5, 0.25),
            source="LightX2V step/CFG distillation (WanStepDistillScheduler): denoising_step_list "
            "[1000, 750, 500, 250], sample_shift 5, enable_cfg false",
        )
    }
)


def check_preset(name: Any) -> Preset | None:
    """None -> None; a known name -> its Preset; anything else is an error listing the names."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in PRESETS:
        raise ValidationError(f"preset {name!r}: allowed values are {', '.join(PRESETS)}")
    return PRESETS[name]


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
