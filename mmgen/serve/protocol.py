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
  own checks, pipelines.wan_plan.resolve_defaults, without running anything), naming the field the
  client sent: `size` for height / width given as a size, `seconds` for frames given as seconds,
  `input_reference` for an uploaded (or missing) image.

Files (POST /v1/videos as a multipart form, `UPLOADS`): `input_reference` (an image: the request's
`image`), and VACE's `video` and `mask` (an MP4 video or one image) and `reference_images` (images;
repeat the field for several). POST /v1/images/edits (`edit_uploads`) takes one file, `image` (the
image to edit: the request's `image`; required, and only as a file), or up to MAX_INPUT_IMAGES of
them, in order, on a model that reads several (condition images). Each is checked by its first
bytes, stored by the server under its own state directory with the job (`upload_suffix` names the
kind), and becomes the request field as the server's path; what it decodes to is judged as a named
file's would be (an unreadable video, a frame count or size other than the request's: a 400 naming
the form field, never resampled).

A multipart form (what the official `openai` client sends, its `extra_body` fields as form fields)
carries strings: `coerce_form` turns each into the type its GenerationRequest annotation names.
Paths (`image`, `video`, `mask`, `reference_images`, `lora`) are refused unless the server was given
a directory for them, and must lie inside it (resolved, symlinks followed) before any file is touched.
"""

from __future__ import annotations

import json
import re
import secrets
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from mmgen.errors import MmgenError, one_line
from mmgen.lora.request import coerce_requests
from pipelines.checks import MAX_PIXELS, MAX_REFERENCE_IMAGES, MAX_SEED
from pipelines.image_input import MAX_INPUT_IMAGES
from pipelines.request import GenerationRequest
from pipelines.request_fields import MAX_PIXELS_CONTEXT, describe_errors

STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled")
VIDEO_OPTIONS = ("model", "size", "seconds", "fps", "input_reference")
IMAGE_OPTIONS = ("model", "size", "n", "response_format", "user")  # user: an end-user id, not used
RESPONSE_FORMATS = ("b64_json", "url")
# The request fields that name files: confined to the server's --input-dir / --lora-dir.
PATH_FIELDS = ("image", "video", "mask", "reference_images", "lora", "loras")
MAX_IMAGES = 4
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")
# The deepest a body's JSON nests: a request's deepest field (a list of LoRA objects) is 3 levels.
MAX_JSON_DEPTH = 16
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


@dataclass(frozen=True)
class UploadField:
    """A file field of a route's form (UPLOADS, EDIT_UPLOADS): the request field it becomes, how many
    files it takes, and the kinds it allows (suffixes, as upload_suffix names them)."""

    field: str
    most: int
    kinds: tuple[str, ...]


IMAGE_KINDS = (".png", ".jpg", ".webp")
VIDEO_KINDS = (".mp4", *IMAGE_KINDS)  # an image is a one-frame video, as for a named path
MAX_REFERENCE_UPLOADS = MAX_REFERENCE_IMAGES
UPLOADS = {
    "input_reference": UploadField("image", 1, IMAGE_KINDS),
    "video": UploadField("video", 1, VIDEO_KINDS),
    "mask": UploadField("mask", 1, VIDEO_KINDS),
    "reference_images": UploadField("reference_images", MAX_REFERENCE_UPLOADS, IMAGE_KINDS),
}
EDIT_UPLOADS = {"image": UploadField("image", 1, IMAGE_KINDS)}  # POST /v1/images/edits: the image to edit
# ... on a model that reads several input images (condition images): the field
# repeated (OpenAI's client sends a list as `image[]`), in order.
SEVERAL_EDIT_UPLOADS = {"image": UploadField("image", MAX_INPUT_IMAGES, IMAGE_KINDS)}
KIND_NAMES = {".png": "PNG", ".jpg": "JPEG", ".webp": "WebP", ".mp4": "MP4"}
# Stored uploads: form field -> the server's copies, in the order sent.
Uploads = Mapping[str, Sequence[Path]]


def edit_uploads(capabilities: Any) -> dict[str, UploadField]:
    """POST /v1/images/edits's files for a loaded model's capabilities (None while loading: as many as any
    model takes, so the body is read and answered 503, not refused for a count the model may take)."""
    several = capabilities is None or capabilities.has("several_images")
    return SEVERAL_EDIT_UPLOADS if several else EDIT_UPLOADS


def input_fields(upload_fields: Sequence[str]) -> tuple[str, ...]:
    """The request fields of a model's form files (GET /health's "uploads"): input_reference -> image."""
    rules = {**EDIT_UPLOADS, **UPLOADS}
    return tuple(rules[name].field for name in upload_fields)


def upload_suffix(param: str, data: bytes, rules: Mapping[str, UploadField] = UPLOADS) -> str:
    """The suffix of an uploaded file's kind, told by its first bytes; a 400 naming `param` when its
    kind is not one `rules[param]` allows (or the field takes no file)."""
    rule = rules.get(param)
    if rule is None:
        raise bad_request(f"{param}: a file is allowed only as {', '.join(rules)}", param)
    suffix = _sniff(data)
    if suffix not in rule.kinds:
        allowed = ", ".join(KIND_NAMES[kind] for kind in rule.kinds)
        found = KIND_NAMES[suffix] if suffix else "of no kind this server reads"
        raise bad_request(
            f"{param}: the uploaded file is {found} (by its first bytes); allowed: {allowed}", param
        )
    return suffix


def _sniff(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return ".png"
    if data.startswith(b"\xff\xd8\xff"):
        return ".jpg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return ".webp"
    if data[4:8] == b"ftyp":  # the ISO base media file format: MP4 (and its relatives, decoded alike)
        return ".mp4"
    return None


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


def parse_json(text: str | bytes, param: str | None) -> Any:
    """JSON text (a body, or a form field's value named `param`) -> its value; a 400 for text that is
    not JSON, an object with a key given twice (named: JSON leaves it to the parser which one wins)
    or nesting deeper than MAX_JSON_DEPTH."""
    where = "the body" if param is None else param
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as err:
        raise bad_request(f"{err.key}: given twice in {where}; give it once", err.key) from None
    except RecursionError:
        raise bad_request(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"{where} is not valid JSON ({err})", param) from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise bad_request(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels", param)
    return value


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _DuplicateKey(key)
        found[key] = value
    return found


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, level = 0, [(value, 1)]
    while level:
        item, depth = level.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            level.extend((child, depth + 1) for child in children)
    return deepest


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
    # What the model does (pipelines.capabilities.Capabilities.to_json); None while it loads.
    capabilities: dict[str, Any] | None = None


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
    # worker allocate (default: the request's own bound, pipelines.checks.MAX_PIXELS).
    max_pixels: int = MAX_PIXELS
    # The loaded model's checks of a request (raise MmgenError naming the field; return the request
    # with the model's defaults filled in, or None); None: none.
    model_check: Callable[[GenerationRequest], GenerationRequest | None] | None = None
    # The request fields naming input files (image, video, mask, reference_images) the loaded model
    # takes (None: not known): a path for any other is refused as the model's refusal, not as a
    # missing --input-dir.
    inputs: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Submission:
    """A checked request: the fields to store (JSON, every one GenerationRequest takes again) and the
    job's response values (model, size, seconds, fps, response_format, n)."""

    fields: dict[str, Any]
    options: dict[str, Any]


def coerce_form(form: dict[str, list[str]]) -> dict[str, Any]:
    """Form strings -> the types GenerationRequest's annotations name; repeated keys only for LoRAs and
    reference images."""
    values: dict[str, Any] = {}
    for name, given in form.items():
        if name in ("lora", "loras"):
            values[name] = [item for text in given for item in _lora_texts(text)]
            continue
        if name == "reference_images":
            values[name] = list(given)
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
        parsed = parse_json(stripped, "lora")
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


def video_submission(body: dict[str, Any], limits: Limits, uploads: Uploads | None = None) -> Submission:
    """POST /v1/videos's body (JSON values) -> a checked Submission; ApiError 400 naming the field.

    uploads: the server's stored copies of the form's files (UPLOADS: `input_reference` -> the
    request's `image`, `video`, `mask`, `reference_images`).
    """
    uploads = dict(uploads or {})
    fields = {key: value for key, value in body.items() if key not in VIDEO_OPTIONS}
    if body.get("input_reference") is not None:
        raise bad_request("input_reference: send the image as a file of a multipart form", "input_reference")
    for param in uploads:
        named = UPLOADS[param].field
        if fields.get(named) not in (None, "", []):
            given = (
                f"{param} and {named} both given"
                if param != named
                else f"{param} given as a file and as a path"
            )
            raise bad_request(f"{given}; give one of them", named)
    _check_model(body.get("model"), limits.model)
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
    sent = {
        **({"height": "size", "width": "size"} if body.get("size") is not None else {}),
        **({"num_frames": "seconds"} if body.get("seconds") is not None else {}),
    }
    request = checked_request(fields, limits, uploads, sent=sent)
    frames_param = "seconds" if body.get("seconds") is not None else "num_frames"
    _check_pixels(request, request.num_frames or limits.num_frames, limits, frames_param)
    if fields.get("image") is None:
        sent["image"] = "input_reference"
    # The model's defaults filled in (a VACE video's own size and frames, an image's aspect ratio).
    resolved = _check_against_model(request, limits, sent, uploads)
    frames = resolved.num_frames or limits.num_frames
    if resolved is not request:
        _check_pixels(resolved, frames, limits, frames_param)
    options = {
        "model": limits.model,
        "fps": fps,
        "size": f"{resolved.width or limits.width}x{resolved.height or limits.height}",
        "seconds": _seconds_text(frames, fps),
    }
    return Submission(_stored_fields(request), options)


def image_submission(
    body: dict[str, Any],
    limits: Limits,
    uploads: Uploads | None = None,
    rules: Mapping[str, UploadField] = EDIT_UPLOADS,
) -> Submission:
    """POST /v1/images/generations's body, or POST /v1/images/edits's with `uploads` (the server's
    stored copies of its `image` files, `rules`: edit_uploads of the model) -> a checked Submission
    (one frame); 400 naming the field."""
    fields = {key: value for key, value in body.items() if key not in IMAGE_OPTIONS}
    _check_model(body.get("model"), limits.model)
    if uploads is not None:
        _check_edit_image(fields, uploads)
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
    sent = {"height": "size", "width": "size"} if "size" in body else {}
    request = checked_request(fields, limits, uploads, rules, sent=sent)
    _check_pixels(request, 1, limits, "size")
    # The model's defaults filled in (an edit's size: the input image's aspect ratio).
    resolved = _check_against_model(request, limits, sent, uploads)
    if resolved is not request:
        _check_pixels(resolved, 1, limits, "size")
    options = {
        "model": limits.model,
        "n": n,
        "response_format": response_format,
        "size": f"{resolved.width or limits.width}x{resolved.height or limits.height}",
    }
    return Submission(_stored_fields(request), options)


def _check_edit_image(fields: dict[str, Any], uploads: Uploads) -> None:
    """POST /v1/images/edits: the image to edit is one uploaded file (EDIT_UPLOADS), never a path."""
    if fields.get("image") is not None:
        raise bad_request("image: send the image to edit as a file of a multipart form", "image")
    if not uploads.get("image"):
        kinds = ", ".join(KIND_NAMES[kind] for kind in EDIT_UPLOADS["image"].kinds)
        raise bad_request(
            f"image: required: the image to edit, a file ({kinds}) of a multipart form", "image"
        )


def _check_against_model(
    request: GenerationRequest, limits: Limits, sent: dict[str, str], uploads: Uploads | None = None
) -> GenerationRequest:
    """The loaded model's checks (Limits.model_check) -> the request with its defaults filled in (or
    as it is); a refusal is a 400 naming the field as the client sent it (`sent`: request field ->
    body field, e.g. height -> size)."""
    if limits.model_check is None:
        return request
    try:
        return limits.model_check(request) or request
    except MmgenError as err:
        message = _hide_uploads(one_line(err), uploads)
        field = _named_field(message) or ("image" if "image" in message else None)
        raise bad_request(message, sent.get(field, field) if field else None) from None


def _hide_uploads(message: str, uploads: Uploads | None) -> str:
    """`message` with the server's paths of uploaded files replaced by what the client sent."""
    for param, paths in (uploads or {}).items():
        for index, path in enumerate(paths):
            shown = f"(uploaded {param}{f' #{index + 1}' if len(paths) > 1 else ''})"
            message = message.replace(str(path), shown)
    return message


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


def checked_request(
    fields: dict[str, Any],
    limits: Limits,
    uploads: Uploads | None = None,
    rules: Mapping[str, UploadField] = UPLOADS,
    *,
    sent: Mapping[str, str] | None = None,
) -> GenerationRequest:
    """GenerationRequest of `fields` after the path checks (`uploads`: the server's copies of uploaded
    files, set as the request fields `rules` names, after the confinement of named paths); a seed is
    drawn when none is given, so a re-run after a restart makes the same frames. ApiError 400 names
    the first bad field as the client sent it (`sent`: request field -> body field, e.g. width ->
    size; an uploaded image's is input_reference)."""
    _refuse_unknown(fields)
    fields = dict(fields)
    _confine_paths(fields, limits)
    sent = dict(sent or {})
    for param, paths in (uploads or {}).items():
        rule = rules[param]
        fields[rule.field] = [str(path) for path in paths] if rule.most > 1 else str(paths[0])
        sent[rule.field] = param
    if fields.get("seed") is None:
        fields["seed"] = secrets.randbelow(MAX_SEED + 1)
    return _validated(fields, limits.max_pixels, sent, uploads)


def check_alone(body: dict[str, Any], options: Sequence[str], model: str) -> None:
    """What a POST body (`options`: the route's own names, VIDEO_OPTIONS or IMAGE_OPTIONS) is refused
    for without the model, while it loads: its `model`, the form of `size` and the request value's own
    checks (sizes, steps, the prompt, ...), a 400 naming the field as sent, so a bad request is told
    at once rather than answered 503 and retried. Paths and the model's own checks wait for the model."""
    _check_model(body.get("model"), model)
    fields = {key: value for key, value in body.items() if key not in options}
    _refuse_unknown(fields)
    for name in PATH_FIELDS:  # confined to the server's directories first: judged once loaded
        fields.pop(name, None)
    _apply_size(body.get("size"), fields)
    sent = {"height": "size", "width": "size"} if body.get("size") is not None else {}
    _validated(fields, None, sent, None)


def _refuse_unknown(fields: Mapping[str, Any]) -> None:
    unknown = sorted(set(fields) - set(GenerationRequest.model_fields) - {"loras"})
    if unknown:
        raise bad_request(
            f"unknown field(s) {', '.join(unknown)}; allowed: {', '.join(GenerationRequest.model_fields)}, "
            "size, seconds, fps, model",
            unknown[0],
        )


def _validated(
    fields: dict[str, Any], max_pixels: int | None, sent: Mapping[str, str], uploads: Uploads | None
) -> GenerationRequest:
    """GenerationRequest.model_validate(fields); a 400 naming the first bad field as sent."""
    try:
        # An input video decodes only up to the pixels one job may make (a small file can hold many frames).
        return GenerationRequest.model_validate(fields, context={MAX_PIXELS_CONTEXT: max_pixels})
    except PydanticValidationError as err:
        first = err.errors()[0]
        message = _hide_uploads("; ".join(describe_errors(err)), uploads)
        # A whole-request check (a preset's conflict) has no location: its message names the field.
        param = str(first["loc"][0]) if first["loc"] else _named_field(message)
        raise bad_request(message, sent.get(param, param) if param else None) from None
    except MmgenError as err:
        message = _hide_uploads(str(err), uploads)
        param = _named_field(message)
        raise bad_request(message, sent.get(param, param) if param else None) from None


def _named_field(message: str) -> str | None:
    head = re.split(r"[ :=]", message, maxsplit=1)[0].lstrip("-").replace("-", "_")
    return head if head in GenerationRequest.model_fields else None


def _stored_fields(request: GenerationRequest) -> dict[str, Any]:
    return request.model_dump(mode="json", include=set(request.model_fields_set))


def _check_model(model: Any, served: str) -> None:
    if model not in (None, "", served):
        raise bad_request(f"model = {model!r}: this server serves {served!r}", "model")


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
    for name in ("video", "mask"):  # VACE's control video and mask: paths like the image's
        if fields.get(name) is not None:
            _check_input(name, limits)
            fields[name] = str(_inside(fields[name], limits.input_dir, name, "--input-dir"))
    for name in ("image", "reference_images"):  # one path, or a list of them (several images)
        value = fields.get(name)
        if value is None or (name == "reference_images" and not value):
            continue
        _check_input(name, limits)
        items = [_inside(item, limits.input_dir, name, "--input-dir") for item in _listed(value)]
        fields[name] = [str(item) for item in items] if isinstance(value, list) else str(items[0])
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


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _check_input(name: str, limits: Limits) -> None:
    """A 400 for an input file the served model does not take (whatever the server's --input-dir)."""
    if limits.inputs is not None and name not in limits.inputs:
        takes = ", ".join(limits.inputs) or "none (text only)"
        raise bad_request(f"{name}: model {limits.model!r} takes no {name} (its input files: {takes})", name)


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
