"""What a user asks for: which LoRA file, at which strength, on which experts; parsed and checked early."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgen.errors import ValidationError

LORA_MODES = ("fused", "unfused")
# The suffixes of LoRA files: 'x.safetensors:abc' is a bad strength, not a file named so.
LORA_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


@dataclass(frozen=True)
class LoRARequest:
    """One LoRA to apply: path, strength (any finite float; 1 = as trained), experts (None = all).

    experts index the pipeline's transformers: 0 = `transformer` (Wan2.2: high noise), 1 =
    `transformer_2` (low noise). sha256, when set, pins the file's bytes: applying it refuses a file
    that has changed since (a render plan records it, so a resumed render never reuses stale jobs).
    """

    path: Path
    strength: float = 1.0
    experts: tuple[int, ...] | None = None
    sha256: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        if isinstance(self.strength, bool) or not isinstance(self.strength, (int, float)):
            raise ValidationError(
                f"LoRA {str(self.path)!r}: strength must be a number, got {self.strength!r}"
            )
        if not math.isfinite(self.strength):
            raise ValidationError(f"LoRA {str(self.path)!r}: strength must be finite, got {self.strength}")
        object.__setattr__(self, "strength", float(self.strength))
        if self.experts is not None:
            experts = tuple(self.experts)
            if not experts or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in experts):
                raise ValidationError(
                    f"LoRA {str(self.path)!r}: experts must be a non-empty list of indices >= 0, got {self.experts!r}"
                )
            object.__setattr__(self, "experts", tuple(sorted(set(experts))))
        if self.sha256 is not None and not (
            isinstance(self.sha256, str)
            and len(self.sha256) == 64
            and set(self.sha256) <= set("0123456789abcdef")
        ):
            raise ValidationError(
                f"LoRA {str(self.path)!r}: sha256 must be 64 lowercase hex digits, got {self.sha256!r}"
            )

    @classmethod
    def parse(cls, text: str) -> LoRARequest:
        """'PATH[:STRENGTH][@EXPERT[,EXPERT]]', e.g. 'style.safetensors:0.8@1' (the CLI's --lora)."""
        rest, experts = text, None
        if "@" in rest:
            rest, _, tail = rest.rpartition("@")
            try:
                experts = tuple(int(part) for part in tail.split(","))
            except ValueError:
                raise ValidationError(
                    f"--lora {text!r}: expert list {tail!r} must be integers, e.g. @0 or @0,1"
                ) from None
        strength = 1.0
        head, sep, tail = rest.rpartition(":")
        if sep and head:
            try:
                strength = float(tail)
            except ValueError:
                # A ':' in the path, unless what precedes it names a LoRA file: then the strength is bad.
                if not Path(rest).exists() and (Path(head).is_file() or Path(head).suffix in LORA_SUFFIXES):
                    raise ValidationError(
                        f"--lora {text!r}: strength {tail!r} is not a number; expected PATH[:STRENGTH], "
                        "e.g. style.safetensors:0.8"
                    ) from None
            else:
                rest = head
        if not rest:
            raise ValidationError(f"--lora {text!r}: no path; expected PATH[:STRENGTH][@EXPERT]")
        return cls(Path(rest), strength, experts)

    @classmethod
    def coerce(cls, value: Any) -> LoRARequest:
        """A LoRARequest, a 'PATH[:STRENGTH][@EXPERT]' string, a Path, or a mapping {path, strength, experts}."""
        if isinstance(value, LoRARequest):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Path):
            return cls(value)
        if isinstance(value, Mapping):
            unknown = set(value) - {"path", "strength", "experts", "sha256"}
            if unknown or "path" not in value:
                raise ValidationError(
                    f"LoRA entry {dict(value)!r}: needs 'path'; allowed keys path, strength, experts, sha256"
                )
            return cls(
                Path(value["path"]), value.get("strength", 1.0), value.get("experts"), value.get("sha256")
            )
        raise ValidationError(f"LoRA entry {value!r}: expected a path string or a mapping with 'path'")

    def to_json(self) -> dict[str, Any]:
        experts = None if self.experts is None else list(self.experts)
        return {"path": str(self.path), "strength": self.strength, "experts": experts, "sha256": self.sha256}


def coerce_requests(value: Any) -> tuple[LoRARequest, ...]:
    """None, one request (str/Path/mapping/LoRARequest) or a sequence of them -> a tuple of LoRARequests."""
    if value is None:
        return ()
    if isinstance(value, (str, Path, Mapping, LoRARequest)):
        return (LoRARequest.coerce(value),)
    if isinstance(value, Sequence):
        return tuple(LoRARequest.coerce(item) for item in value)
    raise ValidationError(f"lora: expected a path, a mapping or a list of them, got {type(value).__name__}")


def check_mode(mode: Any) -> str:
    if mode not in LORA_MODES:
        raise ValidationError(f"lora_mode {mode!r}: allowed values are {', '.join(LORA_MODES)}")
    return mode
