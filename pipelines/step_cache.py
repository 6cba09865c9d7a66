"""Lossy step acceleration for the denoise loop: step caching and CFG truncation (issue 20).

Step caching reuses a step's model output at a later step when a cheap signal says the model's
input changed little. The signal is the change of each expert's *timestep projection* (the 6-way
modulation vector every DiT block receives, WanConditionEmbedder.timestep_embedding), as relative
L1 between consecutive steps, in units of this request's mean step change, accumulated until it
reaches the threshold (TeaCache's rule). Why:
- TeaCache (Liu et al. 2024) showed the timestep-modulated input tracks how much the DiT output
  changes, and its Wan2.1 port reads exactly this timestep embedding;
- it costs one small MLP per step, not a DiT block;
- it depends only on the timestep and the expert's weights, so every rank of a sequence- or
  CFG-parallel group reaches the same decision without communicating, both CFG branches share it
  (one batch-2 call either runs or does not), and the whole schedule is known before the first
  step, so it is recorded with the result (`reuse_schedule`).
Why normalized: the raw distance differs by two orders of magnitude between models (about 0.9 per
step on the embedded random-weight model at 50 steps, about 0.01 on trained Wan2.1, for which
TeaCache fits a per-model polynomial); divided by the schedule's own mean step change, a threshold
means the same on every model: 1.5 reuses a step whose change since the last computed step is
below one and a half average steps, i.e. about every other step where the change is average, more
where the timestep embedding moves slowly. Thresholds are mmgen's own; their costs are measured
with `mmgen ab` (RESULTS.md).

What is reused is each CFG branch's model output (the flow-matching velocity), per expert; the
guidance formula then runs with the current step's scale. In flow matching the velocity is what
stays nearly constant between steps; the output-minus-input residual does not (it moves with the
latents). Never on the first or last step, nor on an expert's first step (its cache is empty).
The cache (`BranchCache`) is created by each denoise call: nothing carries between requests.

CFG truncation runs both branches for the first `ceil(fraction * steps)` steps and only the
conditional branch (batch 1, guidance off) after; fraction 1.0 is the exact guided loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import check_flag


def check_step_cache(value: Any, name: str = "step_cache") -> float | None:
    """None (off) or a threshold >= 0 (0 = never reuse, exact); anything else is an error."""
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValidationError(f"{name} = {value!r}: must be a number >= 0 (a threshold; 0 is exact) or null")
    return float(value)


def check_cfg_truncation(value: Any, name: str = "cfg_truncation") -> float | None:
    """None (off) or the fraction of steps that keep CFG, in (0, 1] (1.0 = exact)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValidationError(
            f"{name} = {value!r}: must be a fraction in (0, 1] of the steps that keep CFG (1.0 is exact) or null"
        )
    return float(value)


def guided_steps(fraction: float | None, total: int) -> int:
    """How many leading steps keep both CFG branches: all when fraction is None, else ceil(fraction * total).

    Rounded to 9 decimals first so that e.g. 0.3 * 50 (15.000000000000002) keeps 15 steps, not 16.
    """
    return total if fraction is None else min(total, math.ceil(round(fraction * total, 9)))


@dataclass(frozen=True)
class Accel:
    """A named, fixed set of lossy settings (`accel=` / `--accel`), named by what it costs.

    fp8_linear / fp8_attention are applied only where they run natively and pay (a CUDA GPU with
    FP8 GEMMs and a bf16 model; FA3 on one GPU for attention): elsewhere (CPU, older GPUs) the
    preset skips them and the result records which were skipped and why (`accel_skipped`), so a
    preset's output there is its step caching + CFG truncation alone, as before they were added.
    """

    name: str
    step_cache: float | None
    cfg_truncation: float | None
    fp8_linear: bool
    fp8_attention: bool
    note: str

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step_cache": self.step_cache,
            "cfg_truncation": self.cfg_truncation,
            "fp8_linear": self.fp8_linear,
            "fp8_attention": self.fp8_attention,
        }


# Thresholds in mean step changes (see the module docstring); measured costs in RESULTS.md 12.
# FP8 in both: each is a net speed-up of the measured CFG step (H100, Wan2.1-1.3B 480p, RESULTS.md
# 12c: FP8 attention 1.14x, DiT output rel. error 1.2e-2; FP8 linears 1.02x at 1.3B, their GEMMs up
# to 1.3x at 14B; both 1.17x, 2.0e-2), small beside what caching and truncation cost (per-step DiT
# error 0.12-0.18, RESULTS.md 12b), and `fast` needs every factor for the 2.5x.
ACCEL_PRESETS = MappingProxyType(
    {
        "fast": Accel(
            "fast",
            step_cache=2.0,
            cfg_truncation=0.8,
            fp8_linear=True,
            fp8_attention=True,
            # 2.0 rather than 1.5: measured end to end at 50 steps (RESULTS.md 12e), 1.5 gave 2.20x and
            # 2.0 gives 2.61x at 1.3B 480p; on the default model it keeps 24/24 prompts (12a'').
            note="more than half the steps cached; CFG for 80% of the steps; FP8 linears and attention where native",
        ),
        "fastest": Accel(
            "fastest",
            step_cache=2.5,
            cfg_truncation=0.6,
            fp8_linear=True,
            fp8_attention=True,
            note="about 2 of 3 steps cached; CFG for 60% of the steps; FP8 linears and attention where native",
        ),
    }
)


def check_accel(name: Any) -> Accel | None:
    """None -> None; a name in ACCEL_PRESETS -> its Accel; anything else is an error listing the names."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in ACCEL_PRESETS:
        raise ValidationError(f"accel {name!r}: allowed values are {', '.join(ACCEL_PRESETS)}")
    return ACCEL_PRESETS[name]


def relative_l1(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean |current - previous| / mean |previous| in float32 (0 when both are zero)."""
    current, previous = current.float(), previous.float()
    scale = float(previous.abs().mean())
    change = float((current - previous).abs().mean())
    return 0.0 if change == 0.0 else change / max(scale, torch.finfo(torch.float32).tiny)


def time_signal(model: Any, timestep: torch.Tensor) -> torch.Tensor:
    """The expert's timestep projection [1, 6 * dim] for a 0-dim timestep (the cache's signal)."""
    embedder = getattr(model, "condition_embedder", None)
    if embedder is None or not hasattr(embedder, "timestep_embedding"):
        raise ValidationError(
            f"step_cache needs a model with a timestep embedder (condition_embedder); {type(model).__name__} has none"
        )
    weight = embedder.time_proj.weight
    t = timestep.to(device=weight.device, dtype=torch.float32).reshape(1)
    return embedder.timestep_embedding(t, weight.dtype)[1]


def reuse_schedule(
    signals: Sequence[torch.Tensor], experts: Sequence[int], threshold: float
) -> tuple[bool, ...]:
    """Which steps reuse the cache: signals[i] is step i's signal, experts[i] its expert.

    Step i reuses when it is neither the first nor the last step, runs the same expert as step
    i-1, and the relative L1 changes accumulated since the last computed step, each divided by the
    mean change between consecutive steps of one expert, stay below `threshold`; a computed step
    resets the sum. Threshold 0 never reuses.
    """
    if len(signals) != len(experts):
        raise ValueError(f"{len(signals)} signals for {len(experts)} steps")
    last = len(signals) - 1
    changes = {
        i: relative_l1(signals[i], signals[i - 1]) for i in range(1, last) if experts[i] == experts[i - 1]
    }
    unit = sum(changes.values()) / len(changes) if changes else 0.0
    reuse = []
    accumulated = 0.0
    for i in range(len(signals)):
        if i not in changes or unit == 0.0:  # first, last, an expert's first step (or no change at all)
            reuse.append(False)
            accumulated = 0.0
            continue
        accumulated += changes[i] / unit
        if accumulated < threshold:
            reuse.append(True)
        else:
            reuse.append(False)
            accumulated = 0.0
    return tuple(reuse)


@dataclass
class BranchCache:
    """One denoise call's stored outputs: {(expert, branch): prediction}; branch 0 = cond, 1 = uncond.

    Created by each denoise call and dropped with it (request-owned state).
    """

    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

    def store(self, expert: int, predictions: Sequence[torch.Tensor]) -> None:
        for branch, prediction in enumerate(predictions):
            self.outputs[(expert, branch)] = prediction

    def load(self, expert: int, branches: int) -> tuple[torch.Tensor, ...] | None:
        """The stored predictions of branches 0..branches-1, or None when any is missing."""
        found = tuple(self.outputs.get((expert, branch)) for branch in range(branches))
        return None if any(p is None for p in found) else found  # type: ignore[return-value]


@dataclass(frozen=True)
class ResolvedAccel:
    """A request's lossy settings after its accel preset is applied (None / False = off).

    from_preset: the FP8 settings that only the preset turned on (the pipeline applies those where
    they run natively, and records them skipped elsewhere); an explicit True is always applied.
    """

    step_cache: float | None
    cfg_truncation: float | None
    fp8_linear: bool | None
    fp8_attention: bool | None
    from_preset: frozenset[str] = frozenset()


def resolve_accel(
    accel: Any,
    step_cache: Any,
    cfg_truncation: Any,
    fp8_linear: Any = None,
    fp8_attention: Any = None,
) -> ResolvedAccel:
    """The checked settings; an accel preset fills those left None, a conflicting explicit value is an error."""
    preset = check_accel(accel)
    given = {
        "step_cache": check_step_cache(step_cache),
        "cfg_truncation": check_cfg_truncation(cfg_truncation),
        "fp8_linear": check_flag(fp8_linear, "fp8_linear"),
        "fp8_attention": check_flag(fp8_attention, "fp8_attention"),
    }
    from_preset = set()
    if preset is not None:
        for name, value in given.items():
            fixed = getattr(preset, name)
            if value is not None and value != fixed:
                raise ValidationError(
                    f"{name} = {value!r} conflicts with accel {preset.name!r}, which sets {fixed!r} "
                    f"({preset.note}); drop accel and set the fields one by one"
                )
            if name.startswith("fp8_") and value is None and fixed:
                from_preset.add(name)
            given[name] = fixed
    return ResolvedAccel(
        step_cache=given["step_cache"],
        cfg_truncation=given["cfg_truncation"],
        fp8_linear=given["fp8_linear"] or None,
        fp8_attention=given["fp8_attention"] or None,
        from_preset=frozenset(from_preset),
    )
