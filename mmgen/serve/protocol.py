"""The HTTP shapes of `mmgen serve`: what a client sends, what it gets back, and the 400s between.

The request body is GenerationRequest's fields under their own names (pipelines/request.py; no field
is listed again here) plus the OpenAI Videos / Images names that map onto them:

- `size` "WxH" -> width, height; `seconds` (with `fps`, default the model's) -> num_frames =
  seconds * fps + 1. A value that does not map exactly (a fractional frame count, a size that
  disagrees with an explicit height) is a 400 naming the field, never a silent change.
- `model`: the served model's name (anything else is a 400).
- Images: `n`, `response_format` (b64_json | url); a frame count other than 1 is a 400.
- What only the loaded model can judge (an image for a text-to-video model, a side that is not a
  multiple of its spatial multiple, a frame count its temporal stride or patch does not divide, a
  second guidance scale for one expert) is a 400 too, through `Limits.model_check` (the pipeline's
  own checks, pipelines.plan.resolve_defaults, without running anything), naming the field the
  client sent: `size` for height / width given as a size, `seconds` for frames given as seconds,
  `input_reference` for an uploaded (or missing) image.

A multipart form (what the official `openai` client sends, its `extra_body` fields as form fields)
carries strings: `coerce_form` turns each into the type its GenerationRequest annotation names.
Paths (`image`, `lora`) are refused unless the server was given a directory for them, and must lie
inside it (resolved, symlinks followed) before any file is touched.
"""

from __future__ import annotations

import json
import re
import secrets
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from mmgen.errors import MmgenError
from mmgen.lora.request import coerce_requests
from pipelines.checks import MAX_SEED
from pipelines.request import GenerationRequest, describe_errors

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
VIDEO_OPTIONS = ("model", "size", "seconds", "fps", "input_reference")
IMAGE_OPTIONS = ("model", "size", "n", "response_format", "user")  # user: an end-user id, not used
RESPONSE_FORMATS = ("b64_json", "url")
MAX_IMAGES = 4
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


# -- response shapes --


class JobError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """One video job as GET /v1/videos/{id} answers it; mmgen's identity fields once completed."""

    id: str
    object: Literal["video"] = "video"
    status: Literal[STATUSES]
    progress: int
    created_at: int
    completed_at: int | None = None
    model: str
    size: str
    seconds: str
    prompt: str
    error: JobError | None = None
    frames_sha256: str | None = None
    latents_sha256: str | None = None
    output_sha256: str | None = None
    timings: dict[str, float] | None = None
    fingerprint: dict[str, Any] | None = None
    request: dict[str, Any] | None = None


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


class VideoPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mmgen"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- request translation --


@dataclass(frozen=True)
class Limits:
    """What the server allows a request to name: its model, directories for paths, its defaults."""

    model: str
    height: int
    width: int
    num_frames: int
    fps: int
    lora_dir: Path | None = None
    input_dir: Path | None = None
    # frames x height x width one job may ask for: a bound on what a single request can make the
    # worker allocate (default: 1280x720 at 129 frames).
    max_pixels: int = 1280 * 720 * 129
    # The loaded model's checks of a request (raise MmgenError naming the field); None: none.
    model_check: Callable[[GenerationRequest], None] | None = None


@dataclass(frozen=True)
class Submission:
    """A checked request: the fields to store (JSON, every one GenerationRequest takes again) and the
    job's response values (model, size, seconds, fps, response_format, n)."""

    fields: dict[str, Any]
    options: dict[str, Any]


def coerce_form(form: dict[str, list[str]]) -> dict[str, Any]:
    """Form strings -> the types GenerationRequest's annotations name; repeated keys only for LoRAs."""
    values: dict[str, Any] = {}
    for name, given in form.items():
        if name in ("lora", "loras"):
            values[name] = [item for text in given for item in _lora_texts(text)]
            continue
        if len(given) != 1:
            raise bad_request(f"{name}: given {len(given)} times; give it once", name)
        field = GenerationRequest.model_fields.get(name)
        if field is not None:
            values[name] = _from_text(name, given[0], field.annotation)
        else:  # the OpenAI names: n and fps are integers; size, seconds, model stay text
            values[name] = _parse(name, given[0], int) if name in ("n", "fps") else given[0]
    return values


def _lora_texts(text: str) -> list[Any]:
    stripped = text.strip()
    if stripped.startswith(("[", "{")):
        try:
            parsed = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise bad_request(f"lora: not valid JSON ({err.msg})", "lora") from None
        return parsed if isinstance(parsed, list) else [parsed]
    return [text]


def _from_text(name: str, text: str, annotation: Any) -> Any:
    """One form string as the annotation's type (int, float, bool, str, a Literal, or None for '')."""
    kinds = _kinds(annotation)
    if text == "" and type(None) in kinds:
        return None
    for kind, parse in ((bool, _parse_bool), (int, int), (float, float)):
        if kind in kinds:
            return _parse(name, text, parse)
    return text


def _kinds(annotation: Any) -> set[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(arg) for arg in typing.get_args(annotation)))
    if origin is Literal:
        return {type(arg) for arg in typing.get_args(annotation)}
    return {annotation}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(text)


def _parse(name: str, text: str, parse: Any) -> Any:
    try:
        return parse(text.strip())
    except ValueError:
        kind = {int: "an integer", float: "a number", _parse_bool: "true or false"}[parse]
        raise bad_request(f"{name} = {text!r}: must be {kind}", name) from None


def video_submission(body: dict[str, Any], limits: Limits, upload: Path | None = None) -> Submission:
    """POST /v1/videos's body (JSON values) -> a checked Submission; ApiError 400 naming the field.

    upload: the stored `input_reference` image (the server's own file), the request's `image`.
    """
    fields = {key: value for key, value in body.items() if key not in VIDEO_OPTIONS}
    if body.get("input_reference") is not None:
        raise bad_request("input_reference: send the image as a file of a multipart form", "input_reference")
    if upload is not None and fields.get("image") is not None:
        raise bad_request("input_reference and image both given; give one of them", "image")
    _check_model(body.get("model"), limits)
    fps = _positive_int("fps", body.get("fps", limits.fps))
    _apply_size(body.get("size"), fields)
    if body.get("seconds") is not None:
        frames = video_frames(body["seconds"], fps)
        if fields.get("num_frames") not in (None, frames):
            raise bad_request(
                f"seconds = {body['seconds']!r} at {fps} fps is {frames} frames, but num_frames = "
                f"{fields['num_frames']!r}; give one of them",
                "seconds",
            )
        fields["num_frames"] = frames
    request = checked_request(fields, limits, upload)
    frames = request.num_frames or limits.num_frames
    _check_pixels(request, frames, limits, "seconds" if body.get("seconds") is not None else "num_frames")
    sent = {
        **({"height": "size", "width": "size"} if body.get("size") is not None else {}),
        **({"num_frames": "seconds"} if body.get("seconds") is not None else {}),
        **({"image": "input_reference"} if upload is not None or fields.get("image") is None else {}),
    }
    _check_against_model(request, limits, sent)
    options = {
        "model": limits.model,
        "fps": fps,
        "size": f"{request.width or limits.width}x{request.height or limits.height}",
        "seconds": _seconds_text(frames, fps),
    }
    return Submission(_stored_fields(request), options)


def image_submission(body: dict[str, Any], limits: Limits) -> Submission:
    """POST /v1/images/generations's body -> a checked Submission (one frame); 400 naming the field."""
    fields = {key: value for key, value in body.items() if key not in IMAGE_OPTIONS}
    _check_model(body.get("model"), limits)
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_IMAGES:
        raise bad_request(f"n = {n!r}: must be an integer in [1, {MAX_IMAGES}]", "n")
    response_format = body.get("response_format") or "b64_json"
    if response_format not in RESPONSE_FORMATS:
        raise bad_request(
            f"response_format = {response_format!r}: allowed values are {', '.join(RESPONSE_FORMATS)}",
            "response_format",
        )
    if fields.get("num_frames", 1) != 1:
        raise bad_request(f"num_frames = {fields['num_frames']!r}: an image is 1 frame", "num_frames")
    fields["num_frames"] = 1
    _apply_size(body.get("size"), fields)
    request = checked_request(fields, limits)
    _check_pixels(request, 1, limits, "num_frames")
    _check_against_model(request, limits, {"height": "size", "width": "size"} if "size" in body else {})
    options = {
        "model": limits.model,
        "n": n,
        "response_format": response_format,
        "size": f"{request.width or limits.width}x{request.height or limits.height}",
    }
    return Submission(_stored_fields(request), options)


def _check_against_model(request: GenerationRequest, limits: Limits, sent: dict[str, str]) -> None:
    """The loaded model's checks (Limits.model_check); a refusal is a 400 naming the field as the
    client sent it (`sent`: request field -> body field, e.g. height -> size)."""
    if limits.model_check is None:
        return
    try:
        limits.model_check(request)
    except MmgenError as err:
        message = " ".join(str(err).split())
        field = _named_field(message) or ("image" if "image" in message else None)
        raise bad_request(message, sent.get(field, field) if field else None) from None


def _check_pixels(request: GenerationRequest, frames: int, limits: Limits, frames_param: str) -> None:
    height, width = request.height or limits.height, request.width or limits.width
    pixels = frames * height * width
    if pixels > limits.max_pixels:
        param = frames_param if request.num_frames is not None else "size"
        raise bad_request(
            f"{frames} frames of {width}x{height} are {pixels} pixels; this server makes at most "
            f"{limits.max_pixels} per job (--max-pixels)",
            param,
        )


def video_frames(seconds: Any, fps: int) -> int:
    """The frame count of `seconds` at `fps` (seconds * fps + 1: the first frame is t = 0); exact or 400."""
    text = str(seconds).strip()
    try:
        duration = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise bad_request(f"seconds = {seconds!r}: must be a number of seconds", "seconds") from None
    if isinstance(seconds, bool) or duration <= 0:
        raise bad_request(f"seconds = {seconds!r}: must be > 0", "seconds")
    intervals = duration * fps
    if intervals.denominator != 1 or intervals % 4:
        raise bad_request(
            f"seconds = {seconds!r} at {fps} fps is {float(intervals):g} frame intervals; it must be a "
            f"multiple of 4 (frames 4k+1): e.g. seconds = {Fraction(4, fps)} or num_frames = 4k+1",
            "seconds",
        )
    return int(intervals) + 1


def checked_request(fields: dict[str, Any], limits: Limits, upload: Path | None = None) -> GenerationRequest:
    """GenerationRequest of `fields` after the path checks (`upload`: the server's copy of an uploaded
    image, the `image`); a seed is drawn when none is given, so a re-run after a restart makes the
    same frames. ApiError 400 names the first bad field."""
    unknown = sorted(set(fields) - set(GenerationRequest.model_fields) - {"loras"})
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(GenerationRequest.model_fields)}, "
            "size, seconds, fps, model",
            unknown[0],
        )
    fields = dict(fields)
    _confine_paths(fields, limits)
    if upload is not None:
        fields["image"] = str(upload)
    if fields.get("seed") is None:
        fields["seed"] = secrets.randbelow(MAX_SEED + 1)
    try:
        return GenerationRequest.model_validate(fields)
    except PydanticValidationError as err:
        first = err.errors()[0]
        message = "; ".join(describe_errors(err))
        # A whole-request check (a preset's conflict) has no location: its message names the field.
        param = str(first["loc"][0]) if first["loc"] else _named_field(message)
        raise bad_request(message, param) from None
    except MmgenError as err:
        raise bad_request(str(err), _named_field(str(err))) from None


def _named_field(message: str) -> str | None:
    head = re.split(r"[ :=]", message, maxsplit=1)[0].lstrip("-").replace("-", "_")
    return head if head in GenerationRequest.model_fields else None


def _stored_fields(request: GenerationRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", include=set(request.model_fields_set))


def _check_model(model: Any, limits: Limits) -> None:
    if model not in (None, "", limits.model):
        raise bad_request(f"model = {model!r}: this server serves {limits.model!r}", "model")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{name} = {value!r}: must be an integer >= 1", name)
    return value


def _apply_size(size: Any, fields: dict[str, Any]) -> None:
    """'WxH' -> width, height in `fields`; a disagreeing explicit height/width is a 400."""
    if size is None:
        return
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise bad_request(f"size = {size!r}: must be 'WIDTHxHEIGHT' in pixels, e.g. '832x480'", "size")
    for name, value in (("width", int(match[1])), ("height", int(match[2]))):
        if fields.get(name) not in (None, value):
            raise bad_request(f"size = {size!r} sets {name} {value}, but {name} = {fields[name]!r}", "size")
        fields[name] = value


def _seconds_text(frames: int, fps: int) -> str:
    return f"{(frames - 1) / fps:g}"


def _confine_paths(fields: dict[str, Any], limits: Limits) -> None:
    """Rewrite `image`, `video`, `mask`, `reference_images` and `lora`/`loras` paths to absolute ones
    inside the allowed directories, or 400.

    Runs before the request is validated, so no path outside them is ever opened or even stat'ed.
    """
    for name in ("image", "video", "mask"):  # VACE's control video and mask: paths like the image's
        if fields.get(name) is not None:
            fields[name] = str(_inside(fields[name], limits.input_dir, name, "--input-dir"))
    references = fields.get("reference_images")
    if references:
        items = references if isinstance(references, list) else [references]
        fields["reference_images"] = [
            str(_inside(item, limits.input_dir, "reference_images", "--input-dir")) for item in items
        ]
    for name in ("lora", "loras"):
        if not fields.get(name):
            continue
        try:
            requests = coerce_requests(fields[name])
        except (MmgenError, TypeError, ValueError) as err:  # a path that is not a string: TypeError
            raise bad_request(f"lora: {err}", "lora") from None
        fields[name] = [
            {**item.to_json(), "path": str(_inside(item.path, limits.lora_dir, "lora", "--lora-dir"))}
            for item in requests
        ]


def _inside(value: Any, directory: Path | None, param: str, flag: str) -> Path:
    if not isinstance(value, (str, Path)):
        raise bad_request(f"{param}: expected a file name inside the server's {flag}", param)
    if directory is None:
        raise bad_request(f"{param}: this server takes no paths for {param} (start it with {flag})", param)
    root = directory.resolve()
    path = (root / value).resolve()
    if not path.is_relative_to(root):
        raise bad_request(f"{param} = {str(value)!r}: not inside the server's {flag}", param)
    return path
