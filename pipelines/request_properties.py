"""The properties each GenerationRequest field declares (pipelines.request_fields.request_field), read back.

The faces list no field themselves: `mmgen generate`'s flags, `mmgen ab`'s variables and fingerprint
allowances, what a result records and which models a field applies to are all read from here.
"""

from __future__ import annotations

from typing import Any

from pipelines.request import GenerationRequest
from pipelines.request_fields import property_of


def field_property(name: str, key: str, default: Any = None) -> Any:
    """Property `key` ('role', 'flag', 'recorded', 'fingerprint', 'lossy_args') of field `name` (see request_field)."""
    return property_of(GenerationRequest.model_fields[name], key, default)


def field_role(name: str) -> str:
    """The role ('job', 'run' or 'lossy') of GenerationRequest field `name`."""
    return str(field_property(name, "role"))


def field_flag(name: str) -> str:
    """The `mmgen generate` flag of field `name`: its own, or --field-name."""
    return str(field_property(name, "flag", "--" + name.replace("_", "-")))


def field_needs(name: str) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """(the capabilities of which a model needs one for field `name` to apply, the values that mean
    "not used"); ((), ()) for a field every model takes (see request_field)."""
    info = GenerationRequest.model_fields[name]
    return tuple(property_of(info, "needs", ())), tuple(property_of(info, "off", ()))


def field_several(name: str) -> tuple[str, ...]:
    """The capabilities of which a model needs one to take several values of field `name` (a tuple);
    () where the field declares none (see request_field)."""
    return tuple(property_of(GenerationRequest.model_fields[name], "several", ()))


def fields_with_role(*roles: str) -> tuple[str, ...]:
    """The request fields whose role is one of `roles`, in definition order."""
    return tuple(name for name in GenerationRequest.model_fields if field_role(name) in roles)


def recorded_fields() -> tuple[str, ...]:
    """The fields result.args carries from the request's record, in definition order."""
    return tuple(name for name in GenerationRequest.model_fields if field_property(name, "recorded"))


def fingerprint_allowances() -> dict[str, tuple[str, ...]]:
    """{field: the fingerprint patterns a change of it may move}, for every field that declares them."""
    fields = GenerationRequest.model_fields
    return {
        name: field_property(name, "fingerprint")
        for name in fields
        if field_property(name, "fingerprint") is not None
    }


def lossy_args() -> tuple[str, ...]:
    """The result.args keys that say how a result was made lossy, field by field."""
    return tuple(
        key for name in GenerationRequest.model_fields for key in field_property(name, "lossy_args", ())
    )


# mmgen ab may vary any field that is not part of the job itself (the jobs must be the same).
AB_VARIABLES = fields_with_role("run", "lossy")


__all__ = (
    "AB_VARIABLES",
    "field_flag",
    "field_needs",
    "field_property",
    "field_role",
    "field_several",
    "fields_with_role",
    "fingerprint_allowances",
    "lossy_args",
    "recorded_fields",
)
