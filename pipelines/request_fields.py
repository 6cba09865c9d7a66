"""How a request field is declared and checked (pipelines.request's GenerationRequest uses these).

`request_field` is pydantic's Field plus mmgen's properties of the field (its role, flag, what it
records, fingerprints and needs; read back with `property_of`), `field_rule` runs one of the runtime's
own checks as a pydantic validator, and `describe_errors` turns pydantic's errors into one line per
field. The bounds a request may ask for live here too, checked before any model loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import Field, ValidationInfo
from pydantic import ValidationError as PydanticValidationError
from pydantic.fields import FieldInfo

from mmgen.errors import ValidationError
from mmgen.lora.request import LoRARequest, coerce_requests
from pipelines.checks import MAX_LORAS, check_size

# What a field does to the output (see the module docstring).
ROLES = ("job", "run", "lossy")
# The validation context key bounding what an input video (`video`, `mask`) may decode to, in
# frames x height x width: `GenerationRequest.model_validate(fields, context={MAX_PIXELS_CONTEXT: N})`
# (the server's --max-pixels; no bound without it).
MAX_PIXELS_CONTEXT = "max_pixels"
# The largest height or width a request may ask for, checked before any model loads. Wan's RoPE
# tables cover 1024 patches of 16 pixels per axis; mmgen caps a side at half of that.
MAX_SIDE = 8192
# The most text tokens a prompt is padded or cut to: the largest any supported model reads
# (Qwen-Image's 1024 prompt tokens; Wan's text_len is 512). An unbounded value is an allocation
# the size of the value (10**6 failed in the allocator, naming no field).
MAX_TEXT_LEN = 1024
# The most characters a prompt (or negative prompt) may have. No model reads more than MAX_TEXT_LEN
# tokens of it, and a token covers a few characters (about 4 in English, one or more per CJK
# character), so 16384 characters hold every token any model reads with room to spare; what is
# longer is cut by the tokenizer anyway, yet costs memory in every record and response it is echoed in.
MAX_PROMPT_CHARS = 16384


def check_side(name: str, value: Any) -> int:
    check_size(name, value)
    if value > MAX_SIDE:
        raise ValidationError(f"{name} = {value}: must be at most {MAX_SIDE} pixels")
    return value


def check_text_len(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_TEXT_LEN:
        raise ValidationError(f"max_sequence_length = {value!r}: must be an integer in [2, {MAX_TEXT_LEN}]")
    return value


def check_prompt(value: str, name: str) -> str:
    """A prompt with some text in it and at most MAX_PROMPT_CHARS characters ('' is refused by the field)."""
    if len(value) > MAX_PROMPT_CHARS:
        raise ValidationError(f"{name}: {len(value)} characters; at most {MAX_PROMPT_CHARS} are allowed")
    if name == "prompt" and value and not value.strip():
        raise ValidationError(f"{name}: must not be blank (it is whitespace only)")
    return value


def check_lora_files(value: Any) -> tuple[LoRARequest, ...]:
    """The LoRA requests of `value` (see mmgen.lora.coerce_requests), at most MAX_LORAS; each file must exist."""
    requests = coerce_requests(value)
    if len(requests) > MAX_LORAS:
        raise ValidationError(f"lora: {len(requests)} LoRAs; at most {MAX_LORAS}")
    missing = [str(r.path) for r in requests if not r.path.is_file()]
    if missing:
        raise ValidationError(f"lora: file(s) not found: {', '.join(missing)}")
    return requests


def check_vace_scale(value: Any) -> float | tuple[float, ...]:
    """A finite number (every VACE hint scaled by it) or a non-empty list of them (one per VACE block,
    in block order; their count is checked against the model when the request is prepared); an int
    is taken as a float."""

    def finite(item: Any) -> bool:
        return not isinstance(item, bool) and isinstance(item, (int, float)) and math.isfinite(item)

    if isinstance(value, (list, tuple)) and value and all(finite(item) for item in value):
        return tuple(float(item) for item in value)
    if not finite(value):
        raise ValidationError(
            f"vace_scale = {value!r}: must be a finite number, or a list of them (one per VACE block)"
        )
    return float(value)


def field_rule(
    check: Callable[..., Any], *, keep: bool = True, bounded: bool = False
) -> Callable[[Any, ValidationInfo], Any]:
    """A pydantic validator running one of the runtime's own checks on a non-None value.

    keep: return the value as given (the check only judges it) rather than what the check returns
    (a float from an int, an ImageInput from a path). mmgen's ValidationError becomes pydantic's
    ValueError, so every face reports it through describe_errors. bounded: the check takes a third
    argument, the validation context's MAX_PIXELS_CONTEXT (None without one).
    """

    def validate(value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        try:
            if bounded:
                checked = check(value, info.field_name, (info.context or {}).get(MAX_PIXELS_CONTEXT))
            else:
                checked = check(value, info.field_name)
        except ValidationError as err:
            raise ValueError(str(err)) from None
        return value if keep else checked

    return validate


def request_field(
    default: Any,
    role: str,
    help: str,
    *,
    flag: str | None = None,
    recorded: bool = False,
    fingerprint: tuple[str, ...] | None = None,
    lossy_args: tuple[str, ...] = (),
    needs: tuple[str, ...] = (),
    off: tuple[Any, ...] = (),
    several: tuple[str, ...] = (),
    **kwargs: Any,
) -> Any:
    """A request field: pydantic's Field plus mmgen's properties of it (read back by property_of).

    role: ROLES. flag: the `mmgen generate` flag when not --field-name. recorded: result.args carries
    the field as the request's record has it. fingerprint: for a field `mmgen ab` may vary, the
    environment-fingerprint fields (dotted, fnmatch patterns) a change of it may move; every other
    fingerprint field must be equal on both sides. lossy_args: the result.args keys that say how the
    field made a result lossy (its resolved value and what it did), copied per row by `mmgen ab`.
    needs: the capabilities (pipelines.capabilities: tasks or features) of which a model must have one
    for the field to apply; a model without any refuses a value other than the default or `off`
    (values that also mean "not used"). Empty: every model takes the field. several: for a field that
    takes one value or a tuple of them (`image`), the capabilities of which a model must have one to
    take several; a model without any refuses a tuple.
    """
    assert role in ROLES, role
    extra: dict[str, Any] = {"role": role, "recorded": recorded}
    if flag is not None:
        extra["flag"] = flag
    if fingerprint is not None:
        extra["fingerprint"] = list(fingerprint)
    if lossy_args:
        extra["lossy_args"] = list(lossy_args)
    if needs:
        extra.update(needs=needs, off=(default, *off))
    if several:
        extra["several"] = several
    return Field(default, description=help, json_schema_extra=extra, **kwargs)


def property_of(info: FieldInfo, key: str, default: Any = None) -> Any:
    """Property `key` of a field declared by request_field (a tuple where a list is kept)."""
    extra = info.json_schema_extra
    assert isinstance(extra, Mapping)
    value = extra.get(key, default)
    return tuple(value) if isinstance(value, list) else value


def describe_errors(err: PydanticValidationError) -> list[str]:
    """One line per field error: 'field = value: what is allowed' (a shared check's text is kept as it is)."""
    lines = []
    for item in err.errors():
        loc = [str(part) for part in item["loc"]]
        field = ".".join(loc) or "(request)"
        given = item.get("input")
        kind = item["type"]
        message = item["msg"].removeprefix("Value error, ")
        if kind == "extra_forbidden":
            message = f"{field}: unknown field (value {given!r})"
        elif kind == "missing":
            message = f"{field}: required"
        elif kind == "string_too_short":
            message = f"{field}: must not be empty"
        elif kind == "literal_error":
            expected = (item.get("ctx") or {}).get("expected", "")
            message = f"{field} = {given!r}: allowed values are {expected.replace(' or ', ', ')}"
        elif kind.endswith("_type") or kind.endswith("_parsing") or kind == "is_instance_of":
            message = f"{field} = {given!r}: {message.lower()}"
        elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            message = f"{field} = {given!r}: {message.lower().removeprefix('input ')}"
        elif loc and not message.startswith((f"{field} ", f"{field}:", f"{loc[-1]} ")):
            message = f"{field}: {message}"
        lines.append(message)
    return lines


__all__ = (
    "MAX_PIXELS_CONTEXT",
    "MAX_PROMPT_CHARS",
    "MAX_SIDE",
    "MAX_TEXT_LEN",
    "ROLES",
    "check_lora_files",
    "check_prompt",
    "check_side",
    "check_text_len",
    "check_vace_scale",
    "describe_errors",
    "field_rule",
    "property_of",
    "request_field",
)
