"""A face's request: `GenerationRequest.from_call`, each error line naming the face's spelling.

The request value words every error ("num_frames = 7: must be 4k+1 ..."); a face adds where the value
came from: `mmgen generate` the flag ("--frames: num_frames = 7: ..."), a render file the file and job.
`request_problems` builds the request through `from_call` and, when that fails, diagnoses the same
fields again one error at a time so each line can be attributed to its field.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import AliasChoices
from pydantic import ValidationError as PydanticValidationError

from mmgen.errors import ValidationError
from pipelines.request import GenerationRequest
from pipelines.request_fields import describe_errors

# (field or None, one error line): None where the line names no single request field.
Problem = tuple[str | None, str]


def request_problems(fields: Mapping[str, Any]) -> tuple[GenerationRequest | None, list[Problem]]:
    """(the request, []) or (None, one (field, line) per mistake) for keyword fields of a request."""
    try:
        return GenerationRequest.from_call(**fields), []
    except ValidationError as err:
        message = str(err)
    try:
        GenerationRequest.model_validate(dict(fields))
    except PydanticValidationError as err:
        lines = [
            _unaliased(item["loc"], line)
            for item, line in zip(err.errors(), describe_errors(err), strict=True)
        ]
        return None, [
            (_field_of(item["loc"], line), line) for item, line in zip(err.errors(), lines, strict=True)
        ]
    except ValidationError as err:
        message = str(err)
    return None, [(_named_field(message), message)]


def build_request(fields: Mapping[str, Any], *, spell: Callable[[str], str]) -> GenerationRequest:
    """The request of `fields`, or one ValidationError whose lines start with the face's name of each field."""
    request, problems = request_problems(fields)
    if request is not None:
        return request
    raise ValidationError("; ".join(_spelled(field, line, spell) for field, line in problems))


def _spelled(field: str | None, line: str, spell: Callable[[str], str]) -> str:
    """'--frames: num_frames = 7: ...'; a line that already names the face's spelling is kept as it is."""
    if field is None or line.startswith(f"{spell(field)}:"):  # the prompt is spelled as the field is
        return line
    inner = line.removeprefix(f"{field}: ")
    return inner if inner.startswith(spell(field)) else f"{spell(field)}: {line}"


def _unaliased(loc: tuple[Any, ...], line: str) -> str:
    # 'loras: lora: file(s) not found' (the check names the field, describe_errors the alias): one name
    name = field_aliases().get(str(loc[0])) if loc else None
    return line.replace(f"{loc[0]}: {name}: ", f"{loc[0]}: ", 1) if name else line


def _field_of(loc: tuple[Any, ...], line: str) -> str | None:
    if loc and str(loc[0]) in GenerationRequest.model_fields:
        return str(loc[0])
    if loc and str(loc[0]) in field_aliases():
        return field_aliases()[str(loc[0])]
    return _named_field(line)  # a rule across fields (a preset or accel conflict) names its field first


def field_aliases() -> dict[str, str]:
    """{alias: field} of the request's other spellings (`loras` for `lora`)."""
    aliases = {}
    for name, field in GenerationRequest.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            aliases.update({str(choice): name for choice in field.validation_alias.choices if choice != name})
    return aliases


def _named_field(line: str) -> str | None:
    match = re.match(r"([a-z_0-9]+)\b", line)
    name = match.group(1) if match else None
    return name if name in GenerationRequest.model_fields else None


__all__ = ("Problem", "build_request", "field_aliases", "request_problems")
