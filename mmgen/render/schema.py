"""The render YAML file: the top level, the jobs as GenerationRequests, one report with every mistake.

A render file names a model, runtime settings, `defaults` (request fields every job inherits) and
either `jobs` (each a prompt plus its own request fields and an optional name) or a `prompts_file`
(one prompt a line, or JSONL objects shaped like jobs) plus an optional seed policy. The job fields
are GenerationRequest's (pipelines.request): `defaults` merged with each job go through
`GenerationRequest.from_call`, so a job is held to exactly the rules of the Python call and of
`mmgen generate`; `loras:` is the file's spelling of the request's `lora`. Everything, including the
prompts file, is validated here, before any model loads; `load_render_file` raises one
`RenderConfigError` listing every mistake, each line naming the file, the job (index and name) and
the field. The result is a frozen `RenderPlan` of `JobSpec`s, each holding its request.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from mmgen.default_model import NAME as DEFAULT_MODEL_NAME
from mmgen.errors import ValidationError
from mmgen.executors.jobs import JobSpec, ModelSpec
from mmgen.outputs.writers import file_sha256
from mmgen.render.face_request import field_aliases, request_problems
from pipelines.checks import MAX_SEED
from pipelines.loader import check_dtype, resolve_device, resolve_dtype
from pipelines.request import GenerationRequest

# Job names become file names: keep them to a portable alphabet.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
# The keys of `defaults`: every request field but the prompt, in the request's spelling or an alias.
REQUEST_KEYS = tuple(name for name in (*GenerationRequest.model_fields, *field_aliases()) if name != "prompt")
# A job: the request's keys, its prompt, and `name` (the job's, not the request's: its output files).
JOB_KEYS = ("name", "prompt", *REQUEST_KEYS)


class RenderConfigError(ValidationError):
    """A render file has mistakes: `problems` holds one line per mistake (file, job, field)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = f"{len(self.problems)} mistake{'s' if len(self.problems) != 1 else ''} in the render file:"
        super().__init__(self.problems[0] if len(self.problems) == 1 else "\n  ".join([head, *self.problems]))


class _Strict(BaseModel):
    # strict: a YAML "64" (string) is not a height; extra="forbid": a typo is a mistake, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SeedPolicy(_Strict):
    """How jobs without their own seed get one: exactly one of fixed, increment_from, listed."""

    fixed: int | None = Field(None, ge=0, le=MAX_SEED)
    increment_from: int | None = Field(None, ge=0, le=MAX_SEED)
    listed: list[int] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> SeedPolicy:
        chosen = [k for k in ("fixed", "increment_from", "listed") if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(f"set exactly one of fixed, increment_from, listed (got {chosen or 'none'})")
        if self.listed is not None and any(not 0 <= s <= MAX_SEED for s in self.listed):
            raise ValueError(f"listed seeds must be in [0, {MAX_SEED}]")
        return self

    def seed_for(self, index: int) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.increment_from is not None:
            return self.increment_from + index
        assert self.listed is not None
        return self.listed[index]


class RenderFile(_Strict):
    """The top level of a render YAML file (`defaults` and `jobs` are checked as requests, below)."""

    model: str = Field("default", min_length=1)
    task: Literal["t2v", "t2i", "i2v"] = "t2v"
    dtype: str = "auto"  # float32 | bfloat16 | float16 or fp32 | bf16 | fp16 (pipelines.loader.check_dtype)
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    fps: int | None = Field(None, ge=1, le=240)  # None: the model directory's default
    output_dir: str | None = None
    defaults: dict[str, Any] = {}
    jobs: list[Any] | None = Field(None, min_length=1)
    prompts_file: str | None = None
    seeds: SeedPolicy | None = None

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        try:  # one name per dtype: fp16 and float16 are the same run (and the same request key)
            return value if value == "auto" else str(check_dtype(value)).removeprefix("torch.")
        except ValidationError as err:
            raise ValueError(str(err).removeprefix("dtype ")) from None


TOP_LEVEL_NAMES = tuple(RenderFile.model_fields)
# Run settings of the file (not request fields) that decide a job's output: part of its request key.
RUN_SETTINGS = ("model", "task", "dtype", "device", "fps")


@dataclass(frozen=True)
class RenderPlan:
    """A validated render file: model and runtime settings plus every resolved job."""

    source: Path
    model: str
    task: str
    dtype: str
    device: str
    fps: int | None
    output_dir: Path
    jobs: tuple[JobSpec, ...]

    @property
    def output_suffix(self) -> str:
        return ".png" if self.task == "t2i" else ".mp4"

    def settings(self) -> dict[str, Any]:
        """The run settings that decide every job's output (RUN_SETTINGS), resolved."""
        device = resolve_device(self.device)
        return {
            # the embedded model's build version: a rebuilt default model is a different model
            "model": f"default:{DEFAULT_MODEL_NAME}" if self.model == "default" else self.model,
            "task": self.task,
            "dtype": resolve_dtype(self.dtype, device),
            "device": device,
            "fps": self.fps,
        }

    def model_spec(self) -> ModelSpec:
        """What every replica of this render loads: weights on the host first when a job offloads
        or plans within a GPU budget."""
        offloading = any(
            job.request.offload in ("model", "layer") or job.request.gpu_memory_gb for job in self.jobs
        )
        return ModelSpec(
            model=self.model,
            task=self.task,
            device=self.device,
            dtype=self.dtype,
            fps=self.fps,
            load_on_host=offloading or None,
        )

    def request_key(self, job: JobSpec) -> str:
        """sha256 of everything that decides a job's output; a finished job is reused only if it matches."""
        request = {**self.settings(), "prompt": job.prompt, "seed": job.seed, "kwargs": job.fields()}
        if job.image_sha256 is not None:  # the image's content, not only its path, decides the output
            request["image_sha256"] = job.image_sha256
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode("utf-8")).hexdigest()


def load_render_file(
    path: Path | str, *, overrides: Sequence[str] = (), output_dir: Path | str | None = None
) -> RenderPlan:
    """Read, override (`key=value` strings, see `apply_overrides`) and validate a render file."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    if overrides:
        raw = apply_overrides(raw, overrides, source=path)
    return build_plan(raw, source=path, output_dir=output_dir)


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """The YAML file's top-level mapping; a missing or unreadable file is one clear line."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RenderConfigError([f"{path}: no such file"]) from None
    except (OSError, UnicodeDecodeError) as err:
        raise RenderConfigError([f"{path}: cannot read the file ({err})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise RenderConfigError([f"{path}: not valid YAML{where}: {problem}"]) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else f"a {type(data).__name__}"
        raise RenderConfigError(
            [f"{path}: the top level must be a mapping (model, defaults, jobs, ...), got {kind}"]
        )
    return data


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], *, source: Path) -> dict[str, Any]:
    """Apply `key=value` settings (value parsed as YAML) to a raw render mapping; returns a new mapping.

    A top-level key (model, dtype, device, ...) replaces that key. A request field (for example
    attention_backend) is set in `defaults` and in every job that sets it itself, so the value holds for
    all jobs: an A/B candidate declares one variable for the whole batch.
    """
    result = {key: value for key, value in raw.items()}
    problems = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(f"--set {item!r}: expected key=value")
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if key in ("defaults", "jobs", "prompts_file", "seeds", "output_dir"):
            problems.append(
                f"--set {key}: only scalar settings can be set (model, dtype, device, fps, task, "
                f"or a request field: {', '.join(REQUEST_KEYS)})"
            )
        elif key in TOP_LEVEL_NAMES:
            result[key] = value
        elif key in REQUEST_KEYS:
            defaults = result.get("defaults")
            result["defaults"] = {**(defaults if isinstance(defaults, dict) else {}), key: value}
            jobs = result.get("jobs")
            if isinstance(jobs, list):
                result["jobs"] = [
                    {**job, key: value} if isinstance(job, dict) and key in job else job for job in jobs
                ]
        else:
            problems.append(
                f"--set {key}: unknown key (allowed: {', '.join((*RUN_SETTINGS, *REQUEST_KEYS))})"
            )
    if problems:
        raise RenderConfigError([f"{source}: {p}" for p in problems])
    return result


def build_plan(raw: dict[str, Any], *, source: Path, output_dir: Path | str | None = None) -> RenderPlan:
    """Validate a raw render mapping and resolve every job; all mistakes are raised together."""
    problems: list[str] = []
    config = _top_level(raw, source, problems)
    entries, entry_where = _job_entries(raw, config, source, problems)
    jobs = _resolve_jobs(config, entries, entry_where, source, problems) if config is not None else []
    base = source.parent
    model = raw.get("model", "default")
    if isinstance(model, str) and model and model != "default":
        model_path = (base / model).resolve()
        if not model_path.is_dir():
            problems.append(f"{source}: model: {model!r} is not a directory ({model_path})")
        model = str(model_path)
    out = _output_dir(config, source, output_dir, problems)
    if problems:
        raise RenderConfigError(problems)
    assert config is not None and out is not None
    return RenderPlan(
        source=source,
        model=model,
        task=config.task,
        dtype=config.dtype,
        device=config.device,
        fps=config.fps,
        output_dir=out,
        jobs=tuple(jobs),
    )


def _top_level(raw: dict[str, Any], source: Path, problems: list[str]) -> RenderFile | None:
    """The file's top level; with mistakes (reported) its valid keys alone, so the jobs are checked too."""
    try:
        return RenderFile.model_validate(raw)
    except PydanticValidationError as err:
        problems.extend(_describe(err, source))
        wrong = {str(item["loc"][0]) for item in err.errors() if item["loc"]}
    try:
        return RenderFile.model_validate({key: value for key, value in raw.items() if key not in wrong})
    except PydanticValidationError:
        return None


def _output_dir(
    config: RenderFile | None, source: Path, given: Path | str | None, problems: list[str]
) -> Path | None:
    """--out, else the file's output_dir (relative to the file), else renders/<file stem>; never a file."""
    if given is not None:
        out, where = Path(given), "--out"
    elif config is not None and config.output_dir is not None:
        out, where = source.parent / config.output_dir, "output_dir"
    elif config is not None:
        out, where = Path("renders") / source.stem, "the default output directory"
    else:
        return None
    if out.exists() and not out.is_dir():
        problems.append(
            f"{source}: {where}: {out} is a file, not a directory (name a directory for the outputs)"
        )
    return out


def _job_entries(
    raw: dict[str, Any], config: RenderFile | None, source: Path, problems: list[str]
) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """The job mappings with their index (from `jobs` or the prompts file) and where each came from.

    An entry that is not a mapping is reported in `problems` and left out; the others are still checked.
    """
    has_jobs, has_file = raw.get("jobs") is not None, raw.get("prompts_file") is not None
    if has_jobs == has_file:
        problems.append(f"{source}: set exactly one of 'jobs' (a list) or 'prompts_file' (a path)")
        return [], []
    if has_jobs:
        jobs_raw = raw["jobs"]
        if not isinstance(jobs_raw, list) or not jobs_raw:
            return [], []  # pydantic already reported the wrong type or the empty list
        entries: list[tuple[int, dict[str, Any]]] = []
        where: list[str] = []
        for index, obj in enumerate(jobs_raw):
            location = f"jobs[{index}]{_name_note(obj)}"
            if not isinstance(obj, dict):
                problems.append(f"{source}: {location}: expected a mapping with a 'prompt', got {obj!r}")
                continue
            entries.append((index, obj))
            where.append(f"{source}: {location}")
        return entries, where
    prompts_file = raw["prompts_file"]
    if not isinstance(prompts_file, str):
        return [], []  # pydantic already reported the wrong type
    return _read_prompts_file(source.parent / prompts_file, source, problems)


def _read_prompts_file(
    path: Path, source: Path, problems: list[str]
) -> tuple[list[tuple[int, dict[str, Any]]], list[str]]:
    """Plain text: one prompt a line ('#' comments and blank lines skipped). JSONL: one job object a line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        problems.append(f"{source}: prompts_file: {path} does not exist")
        return [], []
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"{source}: prompts_file: cannot read {path} ({err})")
        return [], []
    entries: list[tuple[int, dict[str, Any]]] = []
    where: list[str] = []
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or (not jsonl and text.startswith("#")):
            continue
        if not jsonl:
            entries.append((len(entries), {"prompt": text}))
            where.append(f"{source}: {path.name} line {number}")
            continue
        try:
            obj = json.loads(text)
        except ValueError as err:
            problems.append(f"{path}: line {number}: not valid JSON ({err})")
            continue
        if not isinstance(obj, dict):
            problems.append(
                f"{path}: line {number}: expected a JSON object with a 'prompt', got {type(obj).__name__}"
            )
            continue
        entries.append((len(entries), obj))
        where.append(f"{path}: line {number}{_name_note(obj)}")
    if not entries and not any(p.startswith(str(path)) for p in problems):
        problems.append(f"{source}: prompts_file: {path} holds no prompts")
    return entries, where


def _resolve_jobs(
    config: RenderFile,
    entries: list[tuple[int, dict[str, Any]]],
    where: list[str],
    source: Path,
    problems: list[str],
) -> list[JobSpec]:
    """JobSpecs of the entries whose request is valid (defaults merged, seed chosen, image path resolved)."""
    defaults = _checked_defaults(config.defaults, source, problems)
    policy = config.seeds
    if policy is not None and "seed" in config.defaults:
        problems.append(f"{source}: seeds / defaults.seed: set one or the other, not both")
        return []
    total = len(config.jobs) if config.jobs is not None else len(entries)
    if policy is not None and policy.listed is not None and len(policy.listed) != total:
        problems.append(
            f"{source}: seeds.listed: {len(policy.listed)} seeds for {total} jobs (need one per job)"
        )
        return []
    jobs: list[JobSpec] = []
    owner: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for (index, entry), location in zip(entries, where, strict=True):
        label = location.removeprefix(f"{source}: ")
        mistakes = _unknown_keys(entry, JOB_KEYS, location)
        name = _job_name(entry.get("name"), location, label, names, mistakes)
        own = {k: v for k, v in entry.items() if k in REQUEST_KEYS or k == "prompt"}
        fields = {**defaults, **_relative_to(source, own)}
        if policy is not None and policy.listed is not None and "seed" in entry:
            mistakes.append(f"{location}: seed: conflicts with seeds.listed (use one of the two)")
        elif "seed" not in entry and policy is not None:
            fields["seed"] = policy.seed_for(index)
            if fields["seed"] > MAX_SEED:
                mistakes.append(
                    f"{location}: seed: {fields.pop('seed')} is beyond {MAX_SEED} (seeds.increment_from + index)"
                )
        fields.setdefault("seed", 0)
        request, found = request_problems(fields)
        mistakes += [f"{location}: {line}" for _, line in found]
        mistakes += _task_rules(config.task, fields, location) if request is not None else []
        if request is None or mistakes:
            problems.extend(mistakes)
            continue
        job = JobSpec(index=index, name=name, request=_pin_loras(request))
        stem_key = job.stem.lower()
        if stem_key in owner:
            problems.append(
                f"{location}: name: output name {job.stem!r} is also used by {owner[stem_key]}"
                " (give jobs distinct names or seeds)"
            )
            continue
        owner[stem_key] = label
        jobs.append(job)
    return jobs


def _job_name(
    name: Any, location: str, label: str, names: dict[str, tuple[str, str]], mistakes: list[str]
) -> str | None:
    """The job's name, checked (a portable file name, unique regardless of case), or None."""
    if name is None:
        return None
    if not (isinstance(name, str) and re.fullmatch(JOB_NAME_PATTERN, name)):
        mistakes.append(
            f"{location}: name: {name!r} is not allowed (must match the pattern {JOB_NAME_PATTERN!r})"
        )
        return None
    other = names.setdefault(name.lower(), (name, label))  # lowercased name -> (name, where)
    if other[0] != name:
        # fox_s1.mp4 and Fox_s1.mp4 are one file on macOS and Windows filesystems.
        mistakes.append(
            f"{location}: name: {name!r} differs from {other[0]!r} of {other[1]} only "
            "in case (one file on case-insensitive filesystems; give jobs distinct names)"
        )
    return name


def _checked_defaults(defaults: dict[str, Any], source: Path, problems: list[str]) -> dict[str, Any]:
    """The valid part of `defaults` (each mistake reported once here, not again in every job).

    A field's own mistakes hide the rules across fields (a preset or accel conflict) from pydantic:
    the check runs again without the wrong fields until nothing new is found.
    """
    problems.extend(_unknown_keys(defaults, REQUEST_KEYS, f"{source}: defaults", joined="."))
    known = _relative_to(source, {key: value for key, value in defaults.items() if key in REQUEST_KEYS})
    aliases = field_aliases()
    while True:
        _, found = request_problems({"prompt": "(defaults)", **known})
        problems.extend(f"{source}: defaults.{line}" for _, line in found)
        wrong = {field for field, _ in found}
        kept = {key: value for key, value in known.items() if aliases.get(key, key) not in wrong}
        if not found or None in wrong or kept == known:
            return kept
        known = kept


def _relative_to(source: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` with the input files' relative paths (the image or images, VACE's video, mask, reference
    images) made relative to the render file."""
    fields = dict(fields)
    for name in ("video", "mask"):
        if isinstance(fields.get(name), str):
            fields[name] = str(source.parent / fields[name])
    for name in ("image", "reference_images"):  # one path, or a list (several images)
        value = fields.get(name)
        if isinstance(value, str):
            fields[name] = str(source.parent / value) if name == "image" else [str(source.parent / value)]
        elif isinstance(value, list):
            fields[name] = [str(source.parent / i) if isinstance(i, str) else i for i in value]
    return fields


def _unknown_keys(
    mapping: dict[str, Any], allowed: Sequence[str], location: str, joined: str = ": "
) -> list[str]:
    return [
        f"{location}{joined}{key}: unknown key (value {value!r})"
        for key, value in mapping.items()
        if key not in allowed
    ]


def _task_rules(task: str, fields: dict[str, Any], location: str) -> list[str]:
    """What the file's task asks of every job: t2i one frame, i2v an image."""
    if task == "t2i" and fields.get("num_frames", 1) != 1:
        return [f"{location}: num_frames: task t2i renders one frame, got {fields['num_frames']!r}"]
    if task == "i2v" and fields.get("image") is None:
        return [f"{location}: image: task i2v needs an image (per job or in defaults)"]
    return []


def _pin_loras(request: GenerationRequest) -> GenerationRequest:
    """The request with each LoRA file's sha256 pinned: its bytes enter the request key (a changed file
    re-renders its jobs) and the pipeline refuses a file that changes between planning and rendering."""
    if not request.lora or all(lora.sha256 for lora in request.lora):
        return request
    pinned = [{**lora.to_json(), "sha256": lora.sha256 or file_sha256(lora.path)} for lora in request.lora]
    return request.with_values(lora=pinned)


def _name_note(obj: Any) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return f" {obj['name']!r}"
    return ""


def _describe(err: PydanticValidationError, source: Path) -> list[str]:
    """One line per pydantic error of the top level: file, then the field (dotted inside `seeds`)."""
    lines = []
    for item in err.errors():
        loc = [str(part) for part in item["loc"]]
        lines.append(f"{source}: {'.'.join(loc) or '(file)'}: {_message(item)}")
    return lines


def _message(item: dict[str, Any]) -> str:
    kind, given = item["type"], item.get("input")
    if kind == "extra_forbidden":
        return f"unknown key (value {given!r})"
    if kind == "missing":
        return "required"
    if kind == "string_too_short":
        return "must not be empty"
    message = item["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if kind == "string_pattern_mismatch" and isinstance(given, str):
        pattern = (item.get("ctx") or {}).get("pattern")  # shown as written: its case is meaningful
        return f"{given!r} is not allowed (must match the pattern {pattern!r})"
    if kind.endswith("_type") or kind in ("literal_error",) or "greater" in kind or "less" in kind:
        return f"{message.lower()}, got {given!r}"
    return message
