"""The render YAML file: pydantic models, loading, and one report with every mistake in it.

A render file names a model, runtime settings, `defaults` (pipeline arguments every job inherits)
and either `jobs` (each overrides the defaults and needs a prompt) or a `prompts_file` (one prompt a
line, or JSONL objects shaped like jobs) plus an optional seed policy. Everything, including the
prompts file, is validated here, before any model loads; `load_render_file` raises one
`RenderConfigError` listing every mistake, each line naming the file, the job (index and name) and
the field. The result is a frozen `RenderPlan` of fully resolved `JobSpec`s.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from mmgen.attention.fp8 import check_fp8_attention
from mmgen.default_model import NAME as DEFAULT_MODEL_NAME
from mmgen.errors import ValidationError
from mmgen.layers.fp8_linear import check_fp8_linear
from mmgen.outputs.writers import file_sha256
from pipelines.common import (
    MAX_SEED,
    check_attention_backend,
    check_guidance,
    check_num_frames,
    check_seed,
    check_size,
    check_steps,
)
from pipelines.image_input import read_image
from pipelines.loader import resolve_device, resolve_dtype
from pipelines.presets import check_preset
from pipelines.step_cache import check_accel, check_cfg_truncation, check_step_cache

# Job names become file names: keep them to a portable alphabet.
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"


class RenderConfigError(ValidationError):
    """A render file has mistakes: `problems` holds one line per mistake (file, job, field)."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = f"{len(self.problems)} mistake{'s' if len(self.problems) != 1 else ''} in the render file:"
        super().__init__(self.problems[0] if len(self.problems) == 1 else "\n  ".join([head, *self.problems]))


class _Strict(BaseModel):
    # strict: a YAML "64" (string) is not a height; extra="forbid": a typo is a mistake, not ignored.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _pipeline_rule(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run one of the pipeline's own request checks as a pydantic validator (one copy of each rule)."""

    def validate(value: Any) -> Any:
        if value is None:
            return value
        try:
            check(value)
        except ValidationError as err:
            raise ValueError(str(err)) from None
        return value

    return validate


class PipelineArgs(_Strict):
    """Pipeline arguments a job may set or inherit from `defaults`; None means the pipeline's default.

    Types are checked strictly by pydantic; values by the pipeline's own checks (pipelines.common), so
    a render file is held to exactly the rules a direct call would be, before any model loads.
    """

    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    attention_backend: str | None = None
    max_sequence_length: int | None = Field(None, ge=2)
    image: str | None = Field(None, min_length=1)  # I2V / TI2V: a path, relative to the render file
    # Memory (mmgen.placement): where weights live, a GPU budget to plan within, and the plan's parts.
    offload: Literal["none", "model", "layer"] | None = None
    gpu_memory_gb: float | None = Field(None, gt=0)
    cfg: Literal["batch", "sequential"] | None = None
    ffn_chunk: int | None = Field(None, ge=1)
    block_chunk: int | None = Field(None, ge=1)
    decode: Literal["full", "frames", "bands2", "bands4", "bands8", "tiled", "split"] | None = None
    # LoRAs: `loras:` in the file, the pipeline's `lora=`; each entry 'PATH[:STRENGTH][@EXPERT]' or
    # {path, strength, experts}; normalized to mappings so the request key and A/B see values.
    lora: list[str | dict[str, Any]] | None = Field(None, validation_alias="loras")
    lora_mode: Literal["fused", "unfused"] | None = None
    lora_allow_unmatched: bool | None = None
    preset: str | None = None
    # Lossy accelerations (pipelines.step_cache), off unless set: a threshold, a fraction, a preset.
    step_cache: float | None = None
    cfg_truncation: float | None = None
    accel: str | None = None
    fp8_linear: bool | None = None  # FP8 linear layers (mmgen.layers.fp8_linear); off unless true
    fp8_attention: bool | None = None  # FP8 self-attention (mmgen.attention.fp8); off unless true

    _height = field_validator("height")(_pipeline_rule(lambda v: check_size("height", v)))
    _width = field_validator("width")(_pipeline_rule(lambda v: check_size("width", v)))
    _frames = field_validator("num_frames")(_pipeline_rule(check_num_frames))
    _steps = field_validator("num_inference_steps")(_pipeline_rule(check_steps))
    _guidance = field_validator("guidance_scale")(_pipeline_rule(check_guidance))
    _seed = field_validator("seed")(_pipeline_rule(check_seed))
    _backend = field_validator("attention_backend")(_pipeline_rule(check_attention_backend))
    _preset = field_validator("preset")(_pipeline_rule(check_preset))
    _step_cache = field_validator("step_cache")(_pipeline_rule(check_step_cache))
    _cfg_truncation = field_validator("cfg_truncation")(_pipeline_rule(check_cfg_truncation))
    _accel = field_validator("accel")(_pipeline_rule(check_accel))
    _fp8_linear = field_validator("fp8_linear")(_pipeline_rule(check_fp8_linear))
    _fp8_attention = field_validator("fp8_attention")(_pipeline_rule(check_fp8_attention))

    @field_validator("lora")
    @classmethod
    def _loras(cls, value: list[str | dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        from mmgen.lora import coerce_requests

        if value is None:
            return None
        try:
            requests = coerce_requests(value)
        except ValidationError as err:
            raise ValueError(str(err)) from None
        missing = [str(r.path) for r in requests if not r.path.is_file()]
        if missing:
            raise ValueError(f"LoRA file(s) not found: {', '.join(missing)}")
        # Pin each file's bytes: they enter the request key (a changed file re-renders its jobs) and
        # the pipeline refuses a file that changes between planning and rendering.
        return [{**r.to_json(), "sha256": r.sha256 or file_sha256(r.path)} for r in requests]


class JobEntry(PipelineArgs):
    """One job: a prompt (required), an optional name for its output files, and overrides."""

    name: str | None = Field(None, pattern=JOB_NAME_PATTERN)
    prompt: str = Field(min_length=1)


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
    """The top level of a render YAML file."""

    model: str = Field("default", min_length=1)
    task: Literal["t2v", "t2i", "i2v"] = "t2v"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    fps: int | None = Field(None, ge=1, le=240)  # None: the model directory's default
    output_dir: str | None = None
    defaults: PipelineArgs = PipelineArgs()
    jobs: list[JobEntry] | None = Field(None, min_length=1)
    prompts_file: str | None = None
    seeds: SeedPolicy | None = None


# The names a render file uses (a field's alias where it has one: `loras` for the pipeline's `lora`).
PIPELINE_ARG_NAMES = tuple(
    field.validation_alias or name for name, field in PipelineArgs.model_fields.items()
)
TOP_LEVEL_NAMES = tuple(RenderFile.model_fields)


@dataclass(frozen=True)
class JobSpec:
    """One fully resolved job: defaults merged, seed chosen; `kwargs` holds only explicitly set args."""

    index: int
    name: str | None
    prompt: str
    seed: int
    kwargs: tuple[tuple[str, Any], ...]
    image_sha256: str | None = None  # of the job's conditioning image (pipelines.image_input)

    @property
    def label(self) -> str:
        return self.name if self.name is not None else f"job{self.index:03d}"

    @property
    def stem(self) -> str:
        """The stable base name of this job's output files."""
        return f"{self.label}_s{self.seed}"

    def pipeline_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def request(self) -> dict[str, Any]:
        """Prompt, seed, the explicit pipeline args and, for a conditioning image, its content hash."""
        return {
            "prompt": self.prompt,
            "seed": self.seed,
            **self.pipeline_kwargs(),
            **({} if self.image_sha256 is None else {"image_sha256": self.image_sha256}),
        }


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

    def request_key(self, job: JobSpec) -> str:
        """sha256 of everything that decides a job's output; a finished job is reused only if it matches."""
        device = resolve_device(self.device)
        request = {
            # the embedded model's build version: a rebuilt default model is a different model
            "model": f"default:{DEFAULT_MODEL_NAME}" if self.model == "default" else self.model,
            "task": self.task,
            "dtype": resolve_dtype(self.dtype, device),
            "device": device,
            "fps": self.fps,
            "prompt": job.prompt,
            "seed": job.seed,
            "kwargs": job.pipeline_kwargs(),
        }
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

    A top-level key (model, dtype, device, ...) replaces that key. A pipeline argument (for example
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
                f"or a pipeline argument: {', '.join(PIPELINE_ARG_NAMES)})"
            )
        elif key in TOP_LEVEL_NAMES:
            result[key] = value
        elif key in PIPELINE_ARG_NAMES:
            defaults = result.get("defaults")
            result["defaults"] = {**(defaults if isinstance(defaults, dict) else {}), key: value}
            jobs = result.get("jobs")
            if isinstance(jobs, list):
                result["jobs"] = [
                    {**job, key: value} if isinstance(job, dict) and key in job else job for job in jobs
                ]
        else:
            problems.append(
                f"--set {key}: unknown key (allowed: {', '.join((*TOP_LEVEL_NAMES[:5], *PIPELINE_ARG_NAMES))})"
            )
    if problems:
        raise RenderConfigError([f"{source}: {p}" for p in problems])
    return result


def build_plan(raw: dict[str, Any], *, source: Path, output_dir: Path | str | None = None) -> RenderPlan:
    """Validate a raw render mapping and resolve every job; all mistakes are raised together."""
    problems: list[str] = []
    jobs_raw = raw.get("jobs")
    # A non-empty job list is validated entry by entry (_job_entries), so one bad job neither hides
    # the mistakes of the others nor the checks across jobs (duplicate names, seeds, task rules).
    separate = isinstance(jobs_raw, list) and bool(jobs_raw)
    try:
        config = RenderFile.model_validate({k: v for k, v in raw.items() if k != "jobs"} if separate else raw)
    except PydanticValidationError as err:
        config = None
        problems.extend(_describe(err, source, raw))

    entries, entry_where = _job_entries(raw, config, source, problems)
    if config is not None and entries is not None:
        total = len(jobs_raw) if separate else len(entries)
        jobs = _resolve_jobs(config, entries, entry_where, source, problems, total)
    else:
        jobs = ()
    base = source.parent
    model = raw.get("model", "default")
    if isinstance(model, str) and model and model != "default":
        model_path = (base / model).resolve()
        if not model_path.is_dir():
            problems.append(f"{source}: model: {model!r} is not a directory ({model_path})")
        model = str(model_path)
    if problems:
        raise RenderConfigError(problems)
    assert config is not None
    if output_dir is not None:
        out = Path(output_dir)
    elif config.output_dir is not None:
        out = base / config.output_dir
    else:
        out = Path("renders") / source.stem
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


def _job_entries(
    raw: dict[str, Any], config: RenderFile | None, source: Path, problems: list[str]
) -> tuple[list[tuple[int, JobEntry]] | None, list[str]]:
    """The valid job entries with their index (from `jobs` or the prompts file) and where each came from.

    An invalid entry is reported in `problems` and left out; the others are still checked together.
    """
    has_jobs, has_file = raw.get("jobs") is not None, raw.get("prompts_file") is not None
    if has_jobs == has_file:
        problems.append(f"{source}: set exactly one of 'jobs' (a list) or 'prompts_file' (a path)")
        return None, []
    if has_jobs:
        jobs_raw = raw["jobs"]
        if not isinstance(jobs_raw, list) or not jobs_raw:
            return None, []  # pydantic already reported the wrong type or the empty list
        entries: list[tuple[int, JobEntry]] = []
        where: list[str] = []
        for index, obj in enumerate(jobs_raw):
            location = f"jobs[{index}]{_name_note(obj)}"
            try:
                entries.append((index, JobEntry.model_validate(obj)))
                where.append(location)
            except PydanticValidationError as err:
                problems.extend(_describe(err, source, obj, prefix=location))
        return entries, where
    prompts_file = raw["prompts_file"]
    if not isinstance(prompts_file, str):
        return None, []  # pydantic already reported the wrong type
    return _read_prompts_file(source.parent / prompts_file, source, problems)


def _read_prompts_file(
    path: Path, source: Path, problems: list[str]
) -> tuple[list[tuple[int, JobEntry]] | None, list[str]]:
    """Plain text: one prompt a line ('#' comments and blank lines skipped). JSONL: one job object a line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        problems.append(f"{source}: prompts_file: {path} does not exist")
        return None, []
    except (OSError, UnicodeDecodeError) as err:
        problems.append(f"{source}: prompts_file: cannot read {path} ({err})")
        return None, []
    entries: list[tuple[int, JobEntry]] = []
    where: list[str] = []
    jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    for number, line in enumerate(lines, start=1):
        text = line.strip()
        if not text or (not jsonl and text.startswith("#")):
            continue
        location = f"{path.name} line {number}"
        if not jsonl:
            entries.append((len(entries), JobEntry(prompt=text)))
            where.append(location)
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
        try:
            entries.append((len(entries), JobEntry.model_validate(obj)))
            where.append(location)
        except PydanticValidationError as err:
            problems.extend(_describe(err, path, obj, prefix=f"line {number}" + _name_note(obj)))
    if not entries and not any(p.startswith(str(path)) for p in problems):
        problems.append(f"{source}: prompts_file: {path} holds no prompts")
    return entries, where


def _resolve_jobs(
    config: RenderFile,
    entries: list[tuple[int, JobEntry]],
    where: list[str],
    source: Path,
    problems: list[str],
    total: int,
) -> list[JobSpec]:
    """JobSpecs of the valid entries; `total` counts the invalid ones too (seeds.listed needs one each)."""
    policy = config.seeds
    if policy is not None and config.defaults.seed is not None:
        problems.append(f"{source}: seeds / defaults.seed: set one or the other, not both")
        return []
    if policy is not None and policy.listed is not None and len(policy.listed) != total:
        problems.append(
            f"{source}: seeds.listed: {len(policy.listed)} seeds for {total} jobs (need one per job)"
        )
        return []
    defaults = config.defaults.model_dump(exclude_none=True)
    jobs: list[JobSpec] = []
    owner: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}  # lowercased name -> (name, where)
    for (index, entry), location in zip(entries, where, strict=True):
        if entry.name is not None:
            other = names.setdefault(entry.name.lower(), (entry.name, location))
            if other[0] != entry.name:
                # fox_s1.mp4 and Fox_s1.mp4 are one file on macOS and Windows filesystems.
                problems.append(
                    f"{source}: {location}: name: {entry.name!r} differs from {other[0]!r} of {other[1]} only "
                    "in case (one file on case-insensitive filesystems; give jobs distinct names)"
                )
                continue
        if policy is not None and policy.listed is not None and entry.seed is not None:
            problems.append(f"{source}: {location}: seed: conflicts with seeds.listed (use one of the two)")
            continue
        if entry.seed is not None:
            seed = entry.seed
        elif policy is not None:
            seed = policy.seed_for(index)
        else:
            seed = defaults.get("seed", 0)
        if seed > MAX_SEED:
            problems.append(
                f"{source}: {location}: seed: {seed} is beyond {MAX_SEED} (seeds.increment_from + index)"
            )
            continue
        merged = {**defaults, **entry.model_dump(exclude_none=True, exclude={"name", "prompt", "seed"})}
        merged.pop("seed", None)
        if config.task == "t2i" and merged.get("num_frames", 1) != 1:
            problems.append(
                f"{source}: {location}: num_frames: task t2i renders one frame, got {merged['num_frames']}"
            )
            continue
        image_sha256 = None
        if config.task == "i2v" and "image" not in merged:
            problems.append(f"{source}: {location}: image: task i2v needs an image (per job or in defaults)")
            continue
        if "image" in merged:
            path = Path(merged["image"])
            path = path if path.is_absolute() else source.parent / path
            try:
                image_sha256 = read_image(path, field="image").sha256
            except ValidationError as err:
                problems.append(f"{source}: {location}: {err}")
                continue
            merged["image"] = str(path)
        job = JobSpec(
            index=index,
            name=entry.name,
            prompt=entry.prompt,
            seed=seed,
            kwargs=tuple(sorted(merged.items())),
            image_sha256=image_sha256,
        )
        stem_key = job.stem.lower()
        if stem_key in owner:
            problems.append(
                f"{source}: {location}: name: output name {job.stem!r} is also used by {owner[stem_key]}"
                " (give jobs distinct names or seeds)"
            )
            continue
        owner[stem_key] = location
        jobs.append(job)
    return jobs


def _name_note(obj: Any) -> str:
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        return f" {obj['name']!r}"
    return ""


def _describe(err: PydanticValidationError, source: Path, raw: Any, prefix: str | None = None) -> list[str]:
    """One line per pydantic error: file, then the job (index and name) or section, then the field."""
    lines = []
    for item in err.errors():
        loc = list(item["loc"])
        where = prefix
        if where is None and len(loc) >= 2 and loc[0] == "jobs" and isinstance(loc[1], int):
            jobs = raw.get("jobs") if isinstance(raw, dict) else None
            entry = jobs[loc[1]] if isinstance(jobs, list) and loc[1] < len(jobs) else None
            where = f"jobs[{loc[1]}]{_name_note(entry)}"
            loc = loc[2:]
        field = ".".join(str(part) for part in loc) or "(entry)"
        message = _message(item)
        if not message.startswith(f"{loc[-1] if loc else ''} = "):  # pipeline checks name the field already
            message = f"{field}: {message}"
        lines.append(f"{source}: {where + ': ' if where else ''}{message}")
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
