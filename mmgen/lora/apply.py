"""Apply LoRAs (in their internal form) to one or more transformers; undo it bitwise.

Two modes, chosen per request:
- fused: each touched weight becomes W + sum_i s_i * (scale_i * up_i @ down_i + diff_i), computed in
  float32 from the original in one pass (several LoRAs never round against each other) and written
  in place, so stacked q/k/v views (WanDiT.fuse_projections) see it. No per-step cost.
- unfused: each Linear with low-rank terms is taken over by a LowRankLinear (same weight objects,
  the pairs of all LoRAs stacked into one pair beside it); full deltas (`.diff`, bias deltas) are
  merged as in fused mode, since beside the layer they would cost a full GEMM. Layers whose input a
  norm kernel or the attention writes (names.takes_padded_input) then get the "concat" kernel's [W | U] matrix as the
  storage of their weights (mmgen.lora.pack; no second copy), unpacked on removal.
Before anything is touched, every LoRA is checked against every expert it goes to: a key that
matches no weight is an error unless allowed, an image-attention key on a model without those
layers (an I2V LoRA on a T2V model) and a shape that does not fit are one-line errors naming the
file and key. `AppliedLoRAs.remove()` copies the kept originals back (never subtracts), so the
base weights come back bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mmgen.errors import ValidationError
from mmgen.layers.low_rank import LowRankLinear
from mmgen.lora.form import LoRATarget
from mmgen.lora.names import is_image_target, takes_padded_input
from mmgen.lora.pack import pack_concat, unpack_concat
from mmgen.lora.readers import LoRAFile
from mmgen.lora.report import FIRST, ExpertReport, FileReport, LoRAReport
from mmgen.lora.request import LoRARequest, check_mode


@dataclass
class AppliedLoRAs:
    """LoRAs on a set of experts now, and how to take them off. Owned by the caller (e.g. a pipeline)."""

    report: LoRAReport
    originals: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    swaps: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    packed: list[tuple[nn.Module, list[LowRankLinear]]] = field(default_factory=list)  # (expert, holders)
    removed: bool = False
    kept: set[int] = field(default_factory=set)  # ids of the parameters in `originals`

    @torch.no_grad()
    def remove(self) -> None:
        """Put back every taken-over module and copy every kept original into its parameter (in place)."""
        if self.removed:
            return
        for expert, holders in reversed(self.packed):  # weights back in their own storage first
            unpack_concat(expert, holders)
        for parent, child, original in reversed(self.swaps):
            setattr(parent, child, original)
        for parameter, original in reversed(self.originals):
            parameter.copy_(original)
        self.removed = True


@dataclass(frozen=True)
class _Use:
    """One target of one LoRA file going onto one expert's weight at one strength."""

    expert: int
    target: LoRATarget
    strength: float


def resolve_experts(request: LoRARequest, count: int) -> tuple[int, ...]:
    """The experts a request goes to; a multi-expert model needs them named, indices must exist."""
    if request.experts is None:
        if count > 1:
            raise ValidationError(
                f"LoRA {str(request.path)!r}: this model has {count} transformers (experts); say which "
                "the LoRA goes to: PATH[:STRENGTH]@0 (high noise), @1 (low noise) or @0,1 (experts: [...] in YAML)"
            )
        return (0,)
    bad = [e for e in request.experts if e >= count]
    if bad:
        raise ValidationError(
            f"LoRA {str(request.path)!r}: expert {bad[0]} requested, but this model has {count} "
            f"transformer(s) (experts 0..{count - 1})"
        )
    return request.experts


def apply_loras(
    experts: Sequence[nn.Module],
    loras: Sequence[tuple[LoRARequest, LoRAFile]],
    *,
    mode: str = "fused",
    allow_unmatched: bool = False,
) -> AppliedLoRAs:
    """Check every LoRA against the experts it goes to, then apply them all; returns the undo handle.

    experts: the pipeline's transformers in order (0 = transformer, 1 = transformer_2).
    Raises ValidationError before changing anything if any LoRA does not fit.
    """
    check_mode(mode)
    uses, reports = [], []
    for request, lora in loras:
        file_uses, report = _plan(experts, request, lora, allow_unmatched)
        uses.extend(file_uses)
        reports.append(report)
    applied = AppliedLoRAs(
        report=LoRAReport(mode=mode, allow_unmatched=allow_unmatched, files=tuple(reports))
    )
    grouped: dict[tuple[int, str], list[_Use]] = {}
    for use in uses:
        grouped.setdefault((use.expert, use.target.weight), []).append(use)
    params = {index: dict(experts[index].named_parameters()) for index, _ in grouped}
    try:
        with torch.no_grad():
            for (index, _), group in grouped.items():
                _apply_group(experts[index], params[index], group, mode, applied)
            if mode == "unfused":
                for index in sorted({index for index, _ in grouped}):
                    holders = pack_concat(experts[index], takes_padded_input)
                    applied.packed.append((experts[index], holders))
    except BaseException:
        applied.remove()  # never leave a half-applied set behind
        raise
    return applied


def _plan(
    experts: Sequence[nn.Module], request: LoRARequest, lora: LoRAFile, allow_unmatched: bool
) -> tuple[list[_Use], FileReport]:
    contents, name = lora.contents, str(lora.path)
    indices = resolve_experts(request, len(experts))
    uses, per_expert = [], []
    for index in indices:
        params = dict(experts[index].named_parameters())
        matched, weights, not_matched = 0, 0, list(contents.unknown)
        for target in contents.targets:
            weight = params.get(target.weight)
            if weight is None:
                if is_image_target(target.weight):
                    raise ValidationError(
                        f"LoRA file {name!r}: key {target.keys[0]} targets {target.weight}, an image "
                        f"cross-attention layer that expert {index} (a text-to-video model) does not have: "
                        "an I2V LoRA cannot go on a T2V model"
                    )
                not_matched.extend(target.keys)
                continue
            _check_shapes(name, index, target, weight, params)
            uses.append(_Use(index, target, request.strength))
            matched += len(target.keys)
            weights += 1
        if not_matched and not allow_unmatched:
            raise ValidationError(
                f"LoRA file {name!r}: {len(not_matched)} of {contents.key_count} keys match no weight of "
                f"expert {index} (first: {', '.join(not_matched[:FIRST])}); pass allow_unmatched=True "
                "(--lora-allow-unmatched) to apply the rest"
            )
        per_expert.append(ExpertReport(index, matched, weights, tuple(not_matched)))
    pairs = [t.low_rank for t in contents.targets if t.low_rank is not None]
    report = FileReport(
        path=name,
        sha256=lora.sha256,
        format=contents.format,
        strength=request.strength,
        experts=indices,
        keys=contents.key_count,
        ranks=tuple(sorted({p.rank for p in pairs})),
        alphas=tuple(sorted({p.alpha for p in pairs}, key=lambda a: (a is None, a or 0.0))),
        scales=tuple(sorted({p.scale for p in pairs} | _delta_scales(contents.targets))),
        ignored=contents.ignored,
        per_expert=tuple(per_expert),
    )
    return uses, report


def _delta_scales(targets: Sequence[LoRATarget]) -> set[float]:
    # Full deltas apply at scale 1 (times strength); list it when a file has them.
    return {1.0} if any(t.weight_delta is not None for t in targets) else set()


def _check_shapes(name: str, index: int, target: LoRATarget, weight: torch.Tensor, params: dict) -> None:
    def fail(key: str, got: tuple, what: str, expected: tuple) -> None:
        raise ValidationError(
            f"LoRA file {name!r}: key {key} has shape {got}, but expert {index}'s {what} is {expected} "
            "(a LoRA for a different model size?)"
        )

    shape = tuple(weight.shape)
    pair = target.low_rank
    if pair is not None:
        if len(shape) != 2:
            fail(target.keys[0], tuple(pair.down.shape), f"{target.weight} (not a Linear)", shape)
        if pair.down.shape[1] != shape[1] or pair.up.shape[0] != shape[0]:
            got = (tuple(pair.up.shape), tuple(pair.down.shape))
            fail(target.keys[0], got, target.weight, shape)
    if target.weight_delta is not None and tuple(target.weight_delta.shape) != shape:
        fail(target.keys[0], tuple(target.weight_delta.shape), target.weight, shape)
    if target.bias_delta is not None:
        bias = params.get(target.bias)
        if bias is None:
            raise ValidationError(
                f"LoRA file {name!r}: key {target.keys[-1]} is a bias delta, but expert {index} has no {target.bias}"
            )
        if tuple(target.bias_delta.shape) != tuple(bias.shape):
            fail(target.keys[-1], tuple(target.bias_delta.shape), target.bias, tuple(bias.shape))


def _apply_group(
    expert: nn.Module, params: dict[str, torch.Tensor], group: list[_Use], mode: str, applied: AppliedLoRAs
) -> None:
    """Every LoRA's change to one weight (and its bias) on one expert (params: its named parameters)."""
    first = group[0].target
    weight = params[first.weight]
    beside = mode == "unfused"
    merged = [
        u
        for u in group
        if (u.target.low_rank is not None and not beside) or u.target.weight_delta is not None
    ]
    if merged:
        _merge(weight, applied, [(u.strength, u.target, not beside) for u in merged])
    bias_uses = [u for u in group if u.target.bias_delta is not None]
    if bias_uses:
        bias = params[bias_uses[0].target.bias]
        _keep(bias, applied)
        total = bias.detach().float()
        for use in bias_uses:
            delta = use.target.bias_delta.to(device=bias.device, dtype=torch.float32)
            total = total + (use.strength * use.target.bias_scale) * delta
        bias.copy_(total.to(bias.dtype))
    pairs = [u for u in group if u.target.low_rank is not None]
    if beside and pairs:
        _attach_low_rank(expert, first.module, weight, pairs, applied)


def _merge(weight: torch.Tensor, applied: AppliedLoRAs, parts: list[tuple[float, LoRATarget, bool]]) -> None:
    """W <- W + sum s * (scale * up @ down [if with_pair] + diff), in float32 from the original, in place."""
    _keep(weight, applied)
    total = weight.detach().float()
    for strength, target, with_pair in parts:
        pair = target.low_rank
        if with_pair and pair is not None:
            up = pair.up.to(device=weight.device, dtype=torch.float32)
            down = pair.down.to(device=weight.device, dtype=torch.float32)
            total = total + (strength * pair.scale) * (up @ down)
        if target.weight_delta is not None:
            total = total + strength * target.weight_delta.to(device=weight.device, dtype=torch.float32)
    weight.copy_(total.to(weight.dtype))


def _attach_low_rank(
    expert: nn.Module, module_name: str, weight: torch.Tensor, uses: list[_Use], applied: AppliedLoRAs
) -> None:
    module = expert.get_submodule(module_name)
    if type(module) is not nn.Linear:
        raise ValidationError(
            f"unfused LoRA on {module_name}: it is a {type(module).__name__}, not a plain Linear "
            "(remove the LoRAs already applied first, or use lora_mode='fused')"
        )
    dtype, device = weight.dtype, weight.device
    down = torch.cat([u.target.low_rank.down.to(device=device, dtype=torch.float32) for u in uses])
    up = torch.cat(
        [
            (u.strength * u.target.low_rank.scale) * u.target.low_rank.up.to(device, torch.float32)
            for u in uses
        ],
        dim=1,
    )
    parent_name, _, child = module_name.rpartition(".")
    parent = expert.get_submodule(parent_name) if parent_name else expert
    setattr(parent, child, LowRankLinear(module, down.to(dtype), up.to(dtype)))
    applied.swaps.append((parent, child, module))


def _keep(parameter: torch.Tensor, applied: AppliedLoRAs) -> None:
    # Originals go to host memory: a 14B model's LoRA'd weights would otherwise double its GPU footprint.
    if id(parameter) not in applied.kept:
        applied.kept.add(id(parameter))
        applied.originals.append((parameter, parameter.detach().to("cpu", copy=True)))
