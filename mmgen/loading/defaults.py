"""The generation defaults of a loaded model (any family): the request values a caller leaves out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgen.errors import LoadError


@dataclass(frozen=True)
class GenerationDefaults:
    """Defaults of the request fields a caller leaves out, for every family; Wan2.1 T2V's unless given.

    Stored as `mmgen_defaults.json` next to model_index.json (the embedded default model has one);
    every key is optional and an unknown key is an error. negative_prompt None: no negative prompt
    (Qwen-Image's true CFG then does not run). max_sequence_length None: the model's own text length.
    """

    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    negative_prompt: str | None = ""
    max_sequence_length: int | None = None
    fps: int = 16
    # Why these values: where they came from (a file, the variant the checkpoint's configs name), for
    # the output manifest. Not a generation argument: mmgen_defaults.json cannot set it.
    chosen_by: str = dataclasses.field(default="set by the caller", compare=False)

    def __post_init__(self) -> None:
        for name in ("height", "width", "num_frames", "num_inference_steps", "fps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise LoadError(f"generation defaults: {name} = {value!r}, must be a positive integer")
        guidance = self.guidance_scale
        if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not guidance >= 0:
            raise LoadError(f"generation defaults: guidance_scale = {guidance!r}, must be a number >= 0")
        if self.negative_prompt is not None and not isinstance(self.negative_prompt, str):
            raise LoadError(
                f"generation defaults: negative_prompt = {self.negative_prompt!r}, must be a string or null"
            )
        length = self.max_sequence_length
        if length is not None and (not isinstance(length, int) or isinstance(length, bool) or length < 1):
            raise LoadError(
                f"generation defaults: max_sequence_length = {length!r}, must be a positive integer or null"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: Path) -> GenerationDefaults:
        """From a mmgen_defaults.json dict; unknown keys and bad values raise a LoadError naming `source`."""
        known = {f.name for f in dataclasses.fields(cls)} - {"chosen_by"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise LoadError(
                f"{source}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}"
            )
        try:
            return cls(**data, chosen_by=str(source))
        except LoadError as err:
            raise LoadError(f"{source}: {err}") from err

    def to_dict(self) -> dict[str, Any]:
        """The generation arguments (what mmgen_defaults.json holds; chosen_by and unset ones left out)."""
        values = dataclasses.asdict(self)
        del values["chosen_by"]
        return {name: value for name, value in values.items() if value is not None}

    def request_values(self) -> dict[str, Any]:
        """The defaults by request field name, those set (fps is not a request field)."""
        values = self.to_dict()
        del values["fps"]
        return values
