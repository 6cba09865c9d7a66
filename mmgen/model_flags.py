"""Command-line flags generated from a pydantic model: one flag per field, nothing listed twice.

`add_model_flags` reads each field's annotation, default and description and adds the flag:
- `X | None` is X; `Literal[...]` gives choices; a tuple or list of anything is a repeatable flag
  (each value a string the model parses); `X | tuple[X, ...]` (X a number) takes one X or several,
  comma-separated; any other class (a path-like input) takes a string;
- a bool is `store_true`, its parser default the field's own (False, or None = "not said");
- the help is the field's description (`help_of` may rewrite it); the metavar is the flag's name.
`given_values` reads back only the flags given on the command line, so the model sees exactly the
fields the user set (its `model_fields_set`), and a flag left out takes the model's default.
`DeferredFlagsParser` adds such flags only when its command is parsed or its help shown: the model
may import heavy modules (torch), which `mmgen --help` and the other commands need not pay for.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # annotations only: `mmgen --help` imports no pydantic
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo

# A parser default for fields whose flag was not given (argparse leaves such a default untouched).
NOT_GIVEN = None


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    flag_of: Callable[[str], str],
    skip: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    help_of: Callable[[str, FieldInfo], str] | None = None,
) -> dict[str, str]:
    """Add one flag per field of `model` (but `skip`); returns {field: its flag}.

    flag_of: the flag of a field name (e.g. '--num-frames'). defaults: face defaults that replace
    the field's own for this parser (the face says why; its help should say so).
    """
    skipped, defaults = set(skip), dict(defaults or {})
    flags = {}
    for name, field in model.model_fields.items():
        if name in skipped:
            continue
        flags[name] = flag_of(name)
        text = help_of(name, field) if help_of is not None else (field.description or "")
        options = _flag_options(field)
        if "choices" not in options and options.get("action") in (None, "append"):  # --frames FRAMES
            options["metavar"] = flags[name].lstrip("-").replace("-", "_").upper()
        if name in defaults:
            options["default"] = defaults[name]
        parser.add_argument(flags[name], dest=name, help=text, **options)
    return flags


class DeferredFlagsParser(argparse.ArgumentParser):
    """An ArgumentParser that runs the flag adders given to `defer` on first use (parse, usage, help)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred: list[Callable[[argparse.ArgumentParser], Any]] = []

    def defer(self, add: Callable[[argparse.ArgumentParser], Any]) -> None:
        self._deferred.append(add)

    def add_deferred(self) -> None:
        while self._deferred:
            self._deferred.pop(0)(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.add_deferred()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.add_deferred()
        return super().format_usage()

    def format_help(self) -> str:
        self.add_deferred()
        return super().format_help()


def given_values(
    args: argparse.Namespace, model: type[BaseModel], flags: Mapping[str, str]
) -> dict[str, Any]:
    """The fields whose flags were given (or have a face default), as the model's constructor takes them."""
    values = {}
    for name in flags:
        value = getattr(args, name)
        if value is NOT_GIVEN or (value is False and model.model_fields[name].default is False):
            continue
        values[name] = tuple(value) if isinstance(value, list) else value
    return values


def _flag_options(field: FieldInfo) -> dict[str, Any]:
    """argparse options (type, choices, action, default) for one field's annotation."""
    kind = _without_none(field.annotation)
    origin = typing.get_origin(kind)
    if kind is bool:
        default = field.default if field.default is False else NOT_GIVEN
        return {"action": "store_true", "default": default}
    if origin is Literal:
        choices = typing.get_args(kind)
        return {"type": type(choices[0]), "choices": choices, "default": NOT_GIVEN}
    if origin in (tuple, list):
        return {"action": "append", "default": NOT_GIVEN}
    if kind in (int, float, str):
        return {"type": kind, "default": NOT_GIVEN}
    number = _number_or_numbers(kind)
    if number is not None:
        return {"type": _OneOrSeveral(number), "default": NOT_GIVEN}
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and any(
        typing.get_origin(item) is tuple for item in typing.get_args(kind)
    ):  # one value or several (`image`): the flag repeated, one value per use
        return {"action": "append", "default": NOT_GIVEN}
    return {"type": str, "default": NOT_GIVEN}  # parsed by the model's own validator


def _number_or_numbers(annotation: Any) -> type | None:
    """X of `X | tuple[X, ...]` where X is int or float; None for any other annotation."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    kinds = typing.get_args(annotation)
    for kind in (int, float):
        if set(kinds) == {kind, tuple[kind, ...]}:
            return kind
    return None


class _OneOrSeveral:
    """An argparse type: '0.5' -> 0.5, '1,0.8,0.6' -> (1.0, 0.8, 0.6) (argparse reports a ValueError,
    naming the type by its __name__)."""

    def __init__(self, kind: type) -> None:
        self.kind = kind
        self.__name__ = f"{kind.__name__}(s)"

    def __call__(self, text: str) -> Any:
        parts = [self.kind(part) for part in text.split(",")]
        return parts[0] if len(parts) == 1 else tuple(parts)


def _without_none(annotation: Any) -> Any:
    """X of `X | None` (or Optional[X]); the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)]
        if len(kinds) == 1:
            return kinds[0]
    return annotation


__all__ = ("NOT_GIVEN", "DeferredFlagsParser", "add_model_flags", "given_values")
