"""What a model can do, as one frozen value, and which request fields apply to it (derived, not listed).

A model's `Capabilities`: what it outputs (video or image), the tasks it serves (TASKS), and the
features its pipeline has (FEATURES: a second expert, a memory planner, FP8, a step cache, ...).
Every request field that only some models take names, on the field itself (pipelines.request,
`needs=`), the tasks or features of which a model must have one; so which fields apply to a model,
which form files the server takes for it (`uploads`) and what it refuses, with why, all follow from
its capabilities. A family reports them for each loaded model (`pipe.capabilities`) and the family
registry (mmgen.families) for the family as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mmgen.errors import ValidationError
from pipelines.request import GenerationRequest
from pipelines.request_properties import field_needs, field_several

OUTPUTS = ("video", "image")
# t2v text-to-video, i2v image-to-video (the image required), ti2v text/image-to-video (an image
# optional), t2i text-to-image, edit (an image edited by a prompt), vace (control video, mask, references).
TASKS = ("t2v", "i2v", "ti2v", "t2i", "edit", "vace")
# A pipeline feature -> why a model without it refuses a request field that needs it.
FEATURES = MappingProxyType(
    {
        "two_experts": "it has one transformer (guidance_scale_2 is Wan2.2 A14B's)",
        "compile": "torch.compile of its blocks is not wired yet",
        "memory_planner": "it has no memory planner yet (load with offload= instead)",
        "ffn_chunk": "its blocks have no FFN chunking yet",
        "block_chunk": "its blocks have no token chunking yet",
        "split_decode": "the VAE decodes whole (no split or tiled decode yet)",
        "step_cache": "no step cache yet",
        "cfg_truncation": "no CFG truncation yet",
        "accel": "no acceleration presets yet",
        "fp8_linear": "no FP8 linears yet",
        "fp8_attention": "no FP8 attention yet",
        "parallel": "it runs in one process (no sequence or CFG parallel yet)",
        "several_images": "it reads one input image (several condition images are Qwen-Image-2.1's)",
        "prefix_cache": "it has no cached prefix (Qwen-Image-2.1's text and condition keys and values)",
        "output_resolution": "it sizes its input image by its own rule (output_resolution is Qwen-Image-2.1's)",
    }
)
# Features one model family's own model brings rather than the shared pipeline (Qwen-Image-2.1's
# several condition images, cached prefix and condition-image area): every_feature leaves them out.
MODEL_FEATURES = frozenset({"several_images", "prefix_cache", "output_resolution"})
# Why a model without a task refuses a field that needs it (a model's `notes` may say it better).
TASK_REASONS = MappingProxyType(
    {
        "vace": "it has no VACE control (video, mask and reference images are Wan VACE's)",
        "i2v": "it takes no input image (image-to-video, TI2V and edit models do)",
        "ti2v": "it takes no input image (image-to-video, TI2V and edit models do)",
        "edit": "it takes no input image (image-to-video, TI2V and edit models do)",
    }
)
# The server's form files per task (mmgen.serve.protocol: UPLOADS, EDIT_UPLOADS), in the page's order.
TASK_UPLOADS = MappingProxyType(
    {
        "i2v": ("input_reference",),
        "ti2v": ("input_reference",),
        "vace": ("video", "mask", "reference_images"),
        "edit": ("image",),
    }
)


@dataclass(frozen=True)
class Capabilities:
    """outputs: 'video' or 'image'; tasks: a subset of TASKS; features: a subset of FEATURES' names.
    notes: (capability, why this model lacks it) pairs said instead of the generic reason."""

    outputs: str
    tasks: tuple[str, ...]
    features: frozenset[str] = frozenset()
    notes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = [
            *([f"outputs {self.outputs!r}"] if self.outputs not in OUTPUTS else []),
            *(f"task {t!r}" for t in self.tasks if t not in TASKS),
            *(f"feature {f!r}" for f in sorted(self.features) if f not in FEATURES),
        ]
        if unknown or not self.tasks:
            raise ValidationError(
                f"capabilities: {', '.join(unknown) or 'no task'}; allowed: outputs {', '.join(OUTPUTS)}; "
                f"tasks (at least one) {', '.join(TASKS)}; features {', '.join(FEATURES)}"
            )

    @classmethod
    def every_feature(
        cls, outputs: str, tasks: tuple[str, ...], *, but: tuple[str, ...] = ()
    ) -> Capabilities:
        """A model whose pipeline has every feature of the shared pipeline (not MODEL_FEATURES) except
        those in `but`."""
        features = frozenset(name for name in FEATURES if name not in but and name not in MODEL_FEATURES)
        return cls(outputs, tasks, features)

    def has(self, name: str) -> bool:
        """Whether `name` (a task or a feature) is one of this model's."""
        return name in self.tasks or name in self.features

    def applies(self, field: str) -> bool:
        """Whether request field `field` applies to this model (it needs nothing, or one capability it has)."""
        needs, _ = field_needs(field)
        return not needs or any(self.has(name) for name in needs)

    @property
    def fields(self) -> tuple[str, ...]:
        """The request fields that apply to this model, in the request's order."""
        return tuple(name for name in GenerationRequest.model_fields if self.applies(name))

    @property
    def uploads(self) -> tuple[str, ...]:
        """The form files the server takes for this model (TASK_UPLOADS of its tasks)."""
        found: list[str] = []
        for task in self.tasks:
            found += [name for name in TASK_UPLOADS.get(task, ()) if name not in found]
        return tuple(found)

    def reason(self, field: str) -> str:
        """Why this model does not take `field` (its own note for one of the field's needs, or the generic one)."""
        needs, _ = field_needs(field)
        notes = dict(self.notes)
        for name in needs:
            if name in notes:
                return notes[name]
        first = needs[0]
        return FEATURES.get(first) or TASK_REASONS.get(first) or f"it has no {' or '.join(needs)}"

    def refusals(self, request: GenerationRequest, title: str) -> list[str]:
        """One line per field `request` sets that does not apply to this model (see the module docstring),
        and per field given several values where the model takes one (several_refusals)."""
        lines = []
        for name in GenerationRequest.model_fields:
            _, off = field_needs(name)
            value = getattr(request, name)
            if not self.applies(name) and value not in off:
                lines.append(
                    f"{name} = {_shown(value)!r}: not supported by the {title} pipeline ({self.reason(name)})"
                )
        return lines + self.several_refusals(request, title)

    def several_refusals(self, request: GenerationRequest, title: str) -> list[str]:
        """One line per field given several values (a tuple) that this model takes only one of (a field
        it takes none of is refused by `refusals`)."""
        lines = []
        for name in GenerationRequest.model_fields:
            several, value = field_several(name), getattr(request, name)
            one_only = self.applies(name) and not any(self.has(need) for need in several)
            if several and isinstance(value, tuple) and one_only:
                why = FEATURES.get(several[0], f"it has no {' or '.join(several)}")
                lines.append(f"{name}: {len(value)} given; the {title} pipeline takes one ({why})")
        return lines

    def to_json(self) -> dict[str, Any]:
        """What /health and /v1/models report."""
        return {
            "outputs": self.outputs,
            "tasks": list(self.tasks),
            "features": sorted(self.features),
            "uploads": list(self.uploads),
            "fields": list(self.fields),
        }


def _shown(value: Any) -> Any:
    """A request value as a refusal shows it: an image or video by where it came from (never its pixels)."""
    source = getattr(value, "source", None)
    if isinstance(value, tuple):
        return tuple(_shown(item) for item in value)
    return value if source is None else source
