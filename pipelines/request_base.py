"""How a request is made from keyword arguments and recorded: GenerationRequest's methods that name no field.

GenerationRequest (pipelines.request) declares the fields; this base holds what works on any set of
them: the one constructor every face calls (errors as one mmgen ValidationError naming each field),
copies with changes, and the lossy fields a fingerprint names.
"""

from __future__ import annotations

from typing import Any, Self

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from mmgen.errors import ValidationError
from pipelines.request_fields import describe_errors, property_of


class RequestBase(BaseModel):
    """The field-independent methods of GenerationRequest (module docstring)."""

    @classmethod
    def from_call(cls, **fields: Any) -> Self:
        """The request of keyword arguments (the Python call, a CLI, a YAML job, a JSON body).

        Errors are one mmgen ValidationError naming each bad field, its value and what is allowed.
        """
        unknown = sorted(set(fields) - set(cls.model_fields) - {"loras"})
        if unknown:
            raise ValidationError(
                f"unknown request field(s) {', '.join(unknown)}; allowed: {', '.join(cls.model_fields)}"
            )
        try:
            return cls.model_validate(fields)
        except PydanticValidationError as err:
            raise ValidationError("; ".join(describe_errors(err))) from None
        except ValidationError as err:  # raised by a shared check inside a before-validator
            raise ValidationError(str(err)) from None

    @classmethod
    def from_pipeline_call(cls, prompt: str, negative_prompt: str | None = None, **fields: Any) -> Self:
        """The request of a pipeline's Python call `pipe(prompt, negative_prompt, **fields)`.

        None for a field whose default is not None (compile=None, lora_mode=None) means "the
        default", as keyword arguments always did; every other value is checked as from_call checks it.
        """
        given = {
            name: value
            for name, value in fields.items()
            if value is not None or name not in cls.model_fields or cls.model_fields[name].default is None
        }
        return cls.from_call(prompt=prompt, negative_prompt=negative_prompt, **given)

    def with_values(self, **changes: Any) -> Self:
        """A copy with `changes` applied and validated again (prepare fills the model's defaults this way)."""
        return type(self).from_call(**{**self.fields_set(), **changes})

    def fields_set(self) -> dict[str, Any]:
        """The fields given explicitly (or filled in by prepare), as values the constructor takes again."""
        return {name: getattr(self, name) for name in self.model_fields_set}

    def declared(self) -> dict[str, Any]:
        """The lossy fields this request sets (None / False / () = off): what the fingerprint names."""
        roles = {name: property_of(info, "role") for name, info in type(self).model_fields.items()}
        record = self.model_dump(include={name for name, role in roles.items() if role == "lossy"})
        return {name: value for name, value in record.items() if value not in (None, False, [], ())}
