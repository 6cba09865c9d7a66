"""Whether a request's FP8 parts run: one decision, with its reasons (prepare calls it once).

Two kinds of reason:
- an obstacle: the part would not run natively here (CPU, an older GPU, a float32 model, a width
  not measured to pay, no room for the weight copies, not FA3, several ranks). An accel preset's
  FP8 part is then skipped (recorded in result.args['accel_skipped']), so the preset's output
  there is what it would be without FP8.
- a blocker: the part cannot run at all (CUDA without FP8 GEMMs or with a non-bf16 model, an
  offloading plan, FP8 attention on several ranks or on another kernel). An explicit request is
  then an error, with the same text as before; elsewhere an explicit request runs emulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mmgen.attention.fp8 import FP8_HEAD_DIMS, check_fp8_attention_impl
from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import FP8_LAYERS_BY_WIDTH, check_fp8_device, fp8_gemm_supported
from mmgen.placement.policy import GIB, MemoryPlan
from pipelines.memory import fp8_copy_bytes

FP8_PARTS = ("fp8_linear", "fp8_attention")


@dataclass(frozen=True)
class Fp8Choice:
    """What runs in FP8: the linear layer kinds (empty: none), self-attention, and the preset parts skipped."""

    linear_layers: frozenset[str] = frozenset()
    attention: bool = False
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Fp8Context:
    """The facts the decision reads: where and how the DiT runs this request."""

    device: torch.device
    dtype: torch.dtype
    config: Any  # the experts' WanConfig (they share one width)
    experts: tuple[Any, ...]
    single_rank: bool
    memory: MemoryPlan
    attention: Any  # the AttentionImpl

    @classmethod
    def of(cls, pipeline: Any, memory: MemoryPlan, attention: Any) -> Fp8Context:
        experts = tuple(pipeline.experts)
        return cls(
            pipeline.device,
            pipeline.dtype,
            experts[0].config,
            experts,
            pipeline.layout.is_single,
            memory,
            attention,
        )


def choose_fp8(lossy: Any, context: Fp8Context, wanted_layers: frozenset[str]) -> Fp8Choice:
    """The FP8 parts this request runs. lossy: pipelines.step_cache.resolve_accel's value (fp8_linear,
    fp8_attention, from_preset); wanted_layers: the kinds fp8_linear would run at this width.

    A part asked by an accel preset is skipped on any obstacle or blocker; a part asked explicitly
    raises on a blocker (and runs, emulated where not native, otherwise).
    """
    obstacles = fp8_obstacles(context, wanted_layers)
    skipped, runs = {}, {}
    for part in FP8_PARTS:
        if not getattr(lossy, part):
            runs[part] = False
            continue
        blocker = _blocker(part, context)
        if part in lossy.from_preset and (part in obstacles or blocker is not None):
            skipped[part] = obstacles.get(part, blocker)
            runs[part] = False
        elif blocker is not None:
            raise ValidationError(blocker)
        else:
            runs[part] = True
    layers = wanted_layers if runs["fp8_linear"] else frozenset()
    return Fp8Choice(linear_layers=layers, attention=runs["fp8_attention"], skipped=skipped)


def _blocker(part: str, context: Fp8Context) -> str | None:
    """Why `part` cannot run at all here (the error an explicit request gets), or None."""
    try:
        if part == "fp8_linear":
            check_fp8_device(context.device, context.dtype)
        else:
            check_fp8_attention_impl(context.attention, context.device, context.config.attention_head_dim)
    except ValidationError as err:
        return str(err)
    if part == "fp8_linear" and context.memory.offload != "none":
        # The FP8 weight copies are made and kept on the device the weights run on: an offloading
        # plan would re-quantize every block each step and hold the copies anyway.
        return (
            f"fp8_linear with offload {context.memory.offload!r} is not supported; use offload 'none' "
            "(or a larger gpu_memory_gb)"
        )
    if part == "fp8_attention" and not context.single_rank:
        return "fp8_attention with several ranks per job is not supported; run it on one GPU"
    return None


def fp8_obstacles(context: Fp8Context, fp8_layers: frozenset[str] = frozenset()) -> dict[str, str]:
    """Why fp8_linear / fp8_attention would not run natively in this call ({} when both would).

    Native: a CUDA GPU with FP8 GEMMs (compute capability >= 8.9), a bf16 model, no offloading
    and a width measured to pay (>= 1536) for the linears; FA3 at head dim 64-256 on one GPU
    per job for attention. CPU runs neither natively (it would emulate them, slower than
    float32: a correctness path, not a speed-up).
    """
    if context.device.type != "cuda":
        reason = f"device {context.device.type}: FP8 runs natively on CUDA only (elsewhere emulated, slower)"
        return {"fp8_linear": reason, "fp8_attention": reason}
    obstacles = {}
    linear = _linear_obstacle(context, fp8_layers)
    if linear is not None:
        obstacles["fp8_linear"] = linear
    attention = _attention_obstacle(context)
    if attention is not None:
        obstacles["fp8_attention"] = attention
    return obstacles


def _linear_obstacle(context: Fp8Context, fp8_layers: frozenset[str]) -> str | None:
    plan, narrowest = context.memory, FP8_LAYERS_BY_WIDTH[0][0]
    if not fp8_gemm_supported(context.device):
        capability = ".".join(map(str, torch.cuda.get_device_capability(context.device)))
        return f"compute capability {capability} < 8.9: no FP8 GEMMs"
    if context.dtype != torch.bfloat16:
        return f"dtype {str(context.dtype).removeprefix('torch.')}: FP8 GEMMs need bfloat16"
    if plan.offload != "none":
        return f"offload {plan.offload!r}: FP8 linears need resident weights"
    if context.config.dim < narrowest:
        return f"model width {context.config.dim} < {narrowest}, the narrowest measured: FP8 linears not known to pay"
    if plan.budget_gib is not None and plan.estimate_gib:
        copies = fp8_copy_bytes(context.experts, fp8_layers)
        if max(dict(plan.estimate_gib).values()) + copies / GIB > plan.budget_gib:
            return (
                f"gpu_memory_gb = {plan.budget_gib:g}: no room for the FP8 weight copies "
                f"({copies / GIB:.2f} GiB) beside the plan's estimate"
            )
    return None


def _attention_obstacle(context: Fp8Context) -> str | None:
    attention, head_dim = context.attention, context.config.attention_head_dim
    if not (attention.name == "flash" and attention.provider == "fa3"):
        return f"attention {attention.name}:{attention.provider}: FP8 needs flash:fa3"
    if not FP8_HEAD_DIMS[0] <= head_dim <= FP8_HEAD_DIMS[1]:
        low, high = FP8_HEAD_DIMS
        return f"head dim {head_dim}: FA3's FP8 forward has {low}-{high}"
    if not context.single_rank:
        return "several ranks per job: FP8 attention runs on one GPU"
    return None
