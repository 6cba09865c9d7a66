"""`mmgen ab`: render the same jobs as a baseline and a candidate, and prove what changed.

The candidate is a second render file or the baseline plus `--set key=value` settings. Both must be
the same jobs (names, prompts, seeds, sizes, frame counts, negative prompts); what differs between
them is the *declared* variable set (for example {attention_backend} or {dtype}). After rendering,
each job's two environment fingerprints may differ only in the fields a declared variable may
change (DECLARED_FINGERPRINT_FIELDS); any other difference (torch version, thread count, TF32, GPU)
makes a bit-level comparison meaningless, so the A/B is refused and the fields are listed.

Per job it reports whether the frames sha256 match and, when not, max/mean absolute difference,
PSNR and SSIM over the uint8 frames (from the lossless .frames.npy each side saves, never the lossy
mp4); on the embedded default model also each side's prompt-following score, by the scorer the face
hands in (`prompt_scorer`: `mmgen ab` passes the default model's detector, mmgen.tiny.detector). Times: each side is warmed first with one untimed render of its first job
(start-up, kernel selection and caches are paid there, not by the first timed job), and the report
keeps model load and warm-up apart from the per-job denoise and job times; the ratios are over
those warmed jobs, each with its spread over the jobs, and a warning when the timed jobs are too few
or too far apart to call a speed-up (MIN_TIMED_JOBS, NOISY_SPREAD). It writes ab_report.json and, for every job whose SHAs differ, a contact sheet.
"""

from __future__ import annotations

import fnmatch
import io
import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import yaml

from mmgen.errors import MmgenError, ValidationError
from mmgen.outputs.locations import check_output_dir
from mmgen.outputs.writers import atomic_write_text, frames_sha256, remove_stale_temps
from mmgen.parallel.layout import ParallelConfig
from mmgen.render.contact import write_contact_sheet
from mmgen.render.face_request import field_aliases
from mmgen.render.groups import run_render_groups
from mmgen.render.manifest import MANIFEST_NAME
from mmgen.render.metrics import frame_diff
from mmgen.render.runner import (
    FRAMES_SUFFIX,
    PipelineFactory,
    RenderSummary,
    exclusive_output_dir,
    load_pipeline,
    pending_jobs,
    run_render,
)
from mmgen.render.schema import (
    JobSpec,
    RenderConfigError,
    RenderPlan,
    apply_overrides,
    build_plan,
    read_yaml_mapping,
)
from pipelines.loader import resolve_device, resolve_dtype
from pipelines.request_properties import AB_VARIABLES, fields_with_role, fingerprint_allowances, lossy_args

REPORT_NAME = "ab_report.json"
AB_LOCK_NAME = ".mmgen-ab.lock"
CONTACT_DIR = "contact"

# Fingerprint fields (dotted, fnmatch patterns) that each declared variable may legitimately change:
# a request field declares its own (pipelines.request, `fingerprint`); the settings that are not
# request fields are listed here. Anything not listed for a declared variable must be equal on both sides.
DECLARED_FINGERPRINT_FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        **fingerprint_allowances(),
        # auto backend selection depends on dtype and device, so those may move the providers too.
        "dtype": ("dtype", "attention_providers", "attention_providers.*"),
        "device": ("device", "gpu", "attention_providers", "attention_providers.*"),
        # several ranks per job: the self-attention site reports its exchange (e.g. 'sdpa:sdpa ulysses2')
        "parallel": ("attention_providers", "attention_providers.*"),
    }
)
# --set keys that lay one job over several ranks (mmgen.parallel), not render-file settings:
# gpus = ranks per job; sp, ring and cfg_parallel as `mmgen generate` takes them.
PARALLEL_SETS = ("gpus", "sp", "ring", "cfg_parallel")
# What a candidate's --set may vary: the request's A/B variables (pipelines.request_properties.AB_VARIABLES,
# in the render file's spelling too: `loras`) and the run settings that are not request fields.
RUN_VARIABLES = ("dtype", "device")
SET_KEYS = (
    *AB_VARIABLES,
    *(alias for alias, name in field_aliases().items() if name in AB_VARIABLES),
    *RUN_VARIABLES,
    *PARALLEL_SETS,
)

# uint8 frames [T, H, W, 3] and the job's prompt -> a dict with a 'score' in [0, 1] (or None).
PromptScorer = Callable[[np.ndarray, str], dict[str, Any]]

# The result.args keys that say how a candidate was made lossy (declared by each lossy request field), copied per row.
LOSSY_ARGS = lossy_args()

# When the timings cannot carry a speed-up claim (the report then says so): fewer warm timed jobs than
# MIN_TIMED_JOBS (one or two pairs give no estimate of the run-to-run spread; a single noisy baseline
# run once read as a 10x "speed-up"), or per-job ratios whose largest is more than NOISY_SPREAD times
# the smallest (each job is the same work on both sides, so a 20% disagreement between jobs is noise
# of the size of the effects worth reporting, or an effect that differs by job: no one number).
MIN_TIMED_JOBS = 3
NOISY_SPREAD = 1.2

# Settings that define *which* jobs run (the request's "job" fields, the job's name, the file's task,
# the conditioning image by content); an A/B over different jobs compares nothing.
JOB_IDENTITY_FIELDS = ("name", "task", "image_sha256", *fields_with_role("job"))


class AbRefused(MmgenError):
    """Baseline and candidate are not a fair pair: lists what differs beyond the declared variables."""


@dataclass(frozen=True)
class Expectation:
    """--expect: 'lossless' (every SHA equal) or a PSNR floor ('psnr>=40')."""

    lossless: bool
    psnr_floor: float | None

    @classmethod
    def parse(cls, text: str | None) -> Expectation | None:
        if text is None:
            return None
        if text.strip() == "lossless":
            return cls(lossless=True, psnr_floor=None)
        match = re.fullmatch(r"\s*psnr\s*>=\s*([0-9]+(?:\.[0-9]+)?)\s*", text)
        if match:
            return cls(lossless=False, psnr_floor=float(match.group(1)))
        raise ValidationError(
            f"--expect: {text!r} is not allowed (use 'lossless' or 'psnr>=N', e.g. psnr>=40)"
        )

    def describe(self) -> str:
        return "lossless" if self.lossless else f"psnr>={self.psnr_floor:g}"

    def met_by(self, row: dict[str, Any]) -> bool:
        if row["sha_equal"]:
            return True
        if self.lossless:
            return False
        return row["psnr"] is not None and row["psnr"] >= (self.psnr_floor or 0.0)


@dataclass(frozen=True)
class AbResult:
    """The A/B outcome: the report written to ab_report.json and the process exit code."""

    report: dict[str, Any]
    report_path: Path
    exit_code: int

    def format(self) -> str:
        return format_report(self.report)


def declared_variables(base: RenderPlan, cand: RenderPlan) -> tuple[str, ...]:
    """The settings in which the candidate differs from the baseline; refuses if the jobs differ."""
    problems = []
    declared = set()
    for key in ("model", "fps"):
        if getattr(base, key) != getattr(cand, key):
            declared.add(key)
    if base.task != cand.task:
        problems.append(f"task: {base.task!r} vs {cand.task!r}")
    base_device, cand_device = resolve_device(base.device), resolve_device(cand.device)
    if base_device != cand_device:
        declared.add("device")
    if resolve_dtype(base.dtype, base_device) != resolve_dtype(cand.dtype, cand_device):
        declared.add("dtype")
    if len(base.jobs) != len(cand.jobs):
        problems.append(f"jobs: {len(base.jobs)} in the baseline vs {len(cand.jobs)} in the candidate")
    for b, c in zip(base.jobs, cand.jobs, strict=False):
        b_args, c_args = _compared(b), _compared(c)
        for key in sorted(set(b_args) | set(c_args)):
            if b_args.get(key) == c_args.get(key):
                continue
            if key in JOB_IDENTITY_FIELDS:
                problems.append(
                    f"jobs[{b.index}] {b.label}: {key}: {b_args.get(key)!r} vs {c_args.get(key)!r}"
                )
            else:
                declared.add(key)
    if problems:
        raise AbRefused("A/B needs the same jobs on both sides; they differ in " + "; ".join(problems))
    return tuple(sorted(declared))


def _compared(job: JobSpec) -> dict[str, Any]:
    """A job's name and request as A/B compares them: the input files (conditioning image, VACE's
    video, mask and reference images) by content, not by path."""
    record = job.request.record()
    for name in ("image", "video", "mask", "reference_images"):
        if f"{name}_sha256" in record:
            record.pop(name)
    return {"name": job.name, **record}


def check_set_keys(sets: Sequence[str]) -> None:
    """Each --set names a variable a candidate may vary (SET_KEYS); a job field or a typo is refused."""
    wrong = sorted({item.partition("=")[0].strip() for item in sets} - set(SET_KEYS))
    if wrong:
        raise ValidationError(
            f"--set {', '.join(wrong)}: not a variable a candidate may vary (allowed: {', '.join(SET_KEYS)}); "
            "the jobs themselves (prompt, size, frames, steps, seed, ...) must be the same on both sides"
        )


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}; an empty nested dict stays as its own key."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def undeclared_differences(
    base_fp: dict[str, Any], cand_fp: dict[str, Any], declared: Sequence[str]
) -> dict[str, list[Any]]:
    """Fingerprint fields that differ although no declared variable may change them: {field: [base, cand]}."""
    allowed = [pattern for var in declared for pattern in DECLARED_FINGERPRINT_FIELDS.get(var, ())]
    flat_b, flat_c = flatten(base_fp), flatten(cand_fp)
    differing = {}
    for key in sorted(set(flat_b) | set(flat_c)):
        if flat_b.get(key, "<absent>") == flat_c.get(key, "<absent>"):
            continue
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in allowed):
            continue
        differing[key] = [flat_b.get(key, "<absent>"), flat_c.get(key, "<absent>")]
    return differing


def load_pair(
    base_file: Path | str,
    cand_file: Path | str | None,
    sets: Sequence[str],
    out_dir: Path | str | None,
) -> tuple[RenderPlan, RenderPlan, Path]:
    """Both plans, validated together before any model loads; outputs under out/base and out/candidate."""
    base_file = Path(base_file)
    out = Path(out_dir) if out_dir is not None else Path("ab") / base_file.stem
    if cand_file is None and not sets:
        raise ValidationError("mmgen ab: give a candidate file or at least one --set key=value")
    problems: list[str] = []
    plans: list[RenderPlan | None] = []
    for source, role in ((base_file, "base"), (Path(cand_file) if cand_file else base_file, "candidate")):
        try:
            raw = read_yaml_mapping(source)
            if role == "candidate" and sets:
                raw = apply_overrides(raw, sets, source=source)
            plans.append(build_plan(raw, source=source, output_dir=out / role))
        except RenderConfigError as err:
            problems.extend(f"{role}: {line}" for line in err.problems)
            plans.append(None)
    if problems:
        raise RenderConfigError(problems)
    base, cand = plans
    assert base is not None and cand is not None
    return base, cand, out


def run_ab(
    base_file: Path | str,
    cand_file: Path | str | None = None,
    *,
    sets: Sequence[str] = (),
    out_dir: Path | str | None = None,
    expect: str | None = None,
    reuse: bool = False,
    rows: int = 4,
    show_progress: bool | None = None,
    pipeline_factory: PipelineFactory | None = None,
    warmup: bool = True,
    prompt_scorer: PromptScorer | None = None,
) -> AbResult:
    """Render baseline and candidate (fresh, or reusing finished jobs with reuse=True) and compare them.

    warmup: render each side's first job once, untimed, before its timed jobs (skipped for a side
    with nothing to render and for a multi-rank candidate, whose ranks are other processes).
    prompt_scorer: the default model's prompt-following scorer (the `mmgen ab` face passes
    mmgen.tiny.detector.prompt_following_score), used only when both sides run the embedded default
    model, the one world it knows; None = no prompt-following column.
    """
    expectation = Expectation.parse(expect)
    check_set_keys(sets)
    if rows < 1:
        raise ValidationError(f"--rows = {rows}: must be >= 1 (frames per contact sheet)")
    parallel, sets = parallel_sets(sets)
    # --set gpus=2 alone: the candidate is the baseline file, laid over several ranks
    same_file = cand_file is None and not sets and parallel is not None
    base, cand, out = load_pair(base_file, base_file if same_file else cand_file, sets, out_dir)
    declared = declared_variables(base, cand) + (("parallel",) if parallel is not None else ())
    factory = _shared_loader(pipeline_factory or load_pipeline)
    check_output_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    scorer = _prompt_scorer(base, cand, prompt_scorer)

    def render(plan: RenderPlan, startup: dict[str, Any] | None) -> RenderSummary:
        return run_render(
            plan,
            resume=reuse,
            save_frames=True,
            show_progress=show_progress,
            pipeline_factory=factory,
            replace_others=True,  # OUT belongs to this comparison: a new candidate replaces the old
            # without a successful warm-up the first timed job is recorded cold (left out of the ratios)
            warmed=startup is not None and startup.get("warmup_s") is not None,
        )

    with exclusive_output_dir(out, lock_name=AB_LOCK_NAME, holder="ab"):
        start_comparison(out, reuse=reuse, sides=(base.output_dir, cand.output_dir))
        startup = {"base": warm_up(base, factory, reuse=reuse) if warmup else None}
        summaries = {"base": render(base, startup["base"])}
        if parallel is None:
            startup["candidate"] = warm_up(cand, factory, reuse=reuse) if warmup else None
            summaries["candidate"] = render(cand, startup["candidate"])
        else:
            startup["candidate"] = None
            summaries["candidate"] = run_render_groups(cand, parallel, 1, resume=reuse, save_frames=True)
        report = compare(base, cand, summaries, declared, out, expectation, rows=rows, scorer=scorer)
        report["candidate_sets"] = list(sets)
        report["startup"] = startup
        report_path = atomic_write_text(out / REPORT_NAME, json.dumps(report, indent=2, default=str) + "\n")
    return AbResult(report=report, report_path=report_path, exit_code=report["exit_code"])


def warm_up(plan: RenderPlan, factory: PipelineFactory, *, reuse: bool) -> dict[str, Any] | None:
    """Load the side's model and render its first pending job once, untimed and unsaved.

    Returns {'job', 'load_s', 'warmup_s'} (load_s ~0 when the other side already loaded the same
    model), or None when nothing is left to render. A failing warm-up is left to the timed render,
    which records the job's error as usual.
    """
    todo = pending_jobs(plan, plan.output_dir)[0] if reuse else list(plan.jobs)
    if not todo:
        return None
    job = todo[0]
    tick = time.perf_counter()
    pipe = factory(plan)
    loaded = time.perf_counter()
    try:
        pipe.generate(job.request, progress=False)
    except Exception as err:  # noqa: BLE001 (reported by the timed render of the same job)
        return {"job": job.label, "load_s": loaded - tick, "warmup_s": None, "error": str(err)}
    return {"job": job.label, "load_s": loaded - tick, "warmup_s": time.perf_counter() - loaded}


def _prompt_scorer(base: RenderPlan, cand: RenderPlan, given: PromptScorer | None) -> PromptScorer | None:
    """The prompt-following scorer for this pair: only when both sides run the embedded default model."""
    if base.model != "default" or cand.model != "default":
        return None
    return given


def start_comparison(out: Path, *, reuse: bool, sides: Sequence[Path]) -> None:
    """Clear what a previous (possibly killed) comparison left in OUT, under the comparison's lock.

    The old report and contact sheets go first, so a comparison killed half-way never leaves a
    complete-looking report beside renders it does not describe. Without reuse each side's manifest
    goes too: every job is rendered again and recorded once, not added as a second "ok" record.
    """
    remove_stale_temps(out)
    contact = out / CONTACT_DIR
    remove_stale_temps(contact)
    (out / REPORT_NAME).unlink(missing_ok=True)
    if contact.is_dir():
        for sheet in contact.glob("*.png"):
            sheet.unlink(missing_ok=True)
    if not reuse:
        for side in sides:
            (side / MANIFEST_NAME).unlink(missing_ok=True)


def parallel_sets(sets: Sequence[str]) -> tuple[Any, tuple[str, ...]]:
    """(the candidate's ParallelConfig or None, the other --set items) from --set gpus=2 sp=... cfg_parallel=true."""
    values: dict[str, Any] = {}
    rest = []
    for item in sets:
        key, _, text = item.partition("=")
        if key.strip() in PARALLEL_SETS:
            values[key.strip()] = yaml.safe_load(text)
        else:
            rest.append(item)
    if not values:
        return None, tuple(rest)
    cfg = values.get("cfg_parallel", False)
    if not isinstance(cfg, bool):
        raise ValidationError(f"--set cfg_parallel={cfg!r}: must be true or false")
    config = ParallelConfig.for_gpus(
        values.get("gpus", 2 if cfg else 1), sp=values.get("sp"), cfg=cfg, ring=values.get("ring", 1)
    )
    return (config if config.world_size > 1 else None), tuple(rest)


def _shared_loader(factory: PipelineFactory) -> PipelineFactory:
    """Load a model once for both sides when they use the same model, task, dtype and device."""
    loaded: dict[tuple[str, str, str, str], Any] = {}

    def load(plan: RenderPlan) -> Any:
        device = resolve_device(plan.device)
        key = (plan.model, plan.task, resolve_dtype(plan.dtype, device), device)
        if key not in loaded:
            loaded[key] = factory(plan)
        return loaded[key]

    return load


def compare(
    base: RenderPlan,
    cand: RenderPlan,
    summaries: dict[str, RenderSummary],
    declared: Sequence[str],
    out: Path,
    expectation: Expectation | None,
    *,
    rows: int,
    scorer: PromptScorer | None = None,
) -> dict[str, Any]:
    """The A/B report (a JSON-ready dict) for two finished renders of the same jobs."""
    rows_out: list[dict[str, Any]] = []
    refusals: dict[str, dict[str, list[Any]]] = {}
    failures = []
    for b_outcome, c_outcome in zip(summaries["base"].outcomes, summaries["candidate"].outcomes, strict=True):
        job = b_outcome.job
        row: dict[str, Any] = {"job": job.label, "index": job.index, "seed": job.seed}
        if b_outcome.status == "failed" or c_outcome.status == "failed":
            row["error"] = "; ".join(
                f"{side}: {o.error}" for side, o in (("base", b_outcome), ("candidate", c_outcome)) if o.error
            )
            failures.append(job.label)
            rows_out.append(row)
            continue
        b_rec, c_rec = b_outcome.record or {}, c_outcome.record or {}
        differing = undeclared_differences(
            b_rec.get("fingerprint", {}), c_rec.get("fingerprint", {}), declared
        )
        if differing:
            refusals[job.label] = differing
        row.update(_compare_job(b_rec, c_rec, base, cand, job.stem, out, declared=declared, rows=rows))
        if scorer is not None:
            row.update(_prompt_following(scorer, job.prompt, b_rec, c_rec, base, cand, job.stem))
        rows_out.append(row)
    refused = bool(refusals)
    if refused:
        for row in rows_out:  # a refused pair proves nothing: keep the raw numbers out of the verdict
            row["verdict"] = "refused"
    elif expectation is not None:
        for row in rows_out:
            if "error" not in row:
                row["verdict"] = "ok" if expectation.met_by(row) else "FAILS " + expectation.describe()
    expectation_failed = any(str(row.get("verdict", "")).startswith("FAILS") for row in rows_out)
    exit_code = 2 if refused else (1 if failures or expectation_failed else 0)
    return {
        "baseline": str(base.source),
        "candidate": str(cand.source),
        "declared": list(declared),
        "expect": expectation.describe() if expectation else None,
        "refused": refused,
        "undeclared_differences": refusals,
        "failed_jobs": failures,
        "jobs": rows_out,
        "all_sha_equal": all(row.get("sha_equal") for row in rows_out),
        "summary": summarize(rows_out),
        "expectation_met": None if expectation is None or refused else not expectation_failed,
        "exit_code": exit_code,
    }


def _compare_job(
    b_rec: dict[str, Any],
    c_rec: dict[str, Any],
    base: RenderPlan,
    cand: RenderPlan,
    stem: str,
    out: Path,
    *,
    declared: Sequence[str],
    rows: int,
) -> dict[str, Any]:
    b_time, c_time = b_rec["timings"]["job"], c_rec["timings"]["job"]
    b_denoise, c_denoise = b_rec["timings"].get("denoise"), c_rec["timings"].get("denoise")
    row: dict[str, Any] = {
        "sha_equal": b_rec["frames_sha256"] == c_rec["frames_sha256"],
        "base_frames_sha256": b_rec["frames_sha256"],
        "candidate_frames_sha256": c_rec["frames_sha256"],
        "latents_sha_equal": b_rec["latents_sha256"] == c_rec["latents_sha256"],
        "max_abs": 0,
        "mean_abs": 0.0,
        "psnr": math.inf,
        "ssim": 1.0,
        "base_s": b_time,
        "candidate_s": c_time,
        "time_ratio": c_time / b_time if b_time > 0 else None,
        # the denoise loop alone (no text encode, decode or export), as the pipeline timed it
        "base_denoise_s": b_denoise,
        "candidate_denoise_s": c_denoise,
        "denoise_ratio": c_denoise / b_denoise if b_denoise and c_denoise is not None else None,
        # a side's first job timed without a warm-up (this run's --no-warmup, or a reused record
        # of a render that was not warmed): its time includes start-up, so the summary leaves it out
        "cold": bool(b_rec["timings"].get("cold") or c_rec["timings"].get("cold")),
        "candidate_lossy": {k: c_rec.get("args", {})[k] for k in LOSSY_ARGS if k in c_rec.get("args", {})},
        "image_sha256": b_rec.get("args", {}).get("image_sha256"),
        "base_attention": b_rec.get("attention_providers"),
        "candidate_attention": c_rec.get("attention_providers"),
        # peak GPU memory per stage (GiB; empty off CUDA) and the memory plans, next to the times
        "base_peak_gib": b_rec.get("memory_gib", {}),
        "candidate_peak_gib": c_rec.get("memory_gib", {}),
        "base_memory_plan": b_rec.get("args", {}).get("memory_plan"),
        "candidate_memory_plan": c_rec.get("args", {}).get("memory_plan"),
    }
    if row["sha_equal"]:
        row["psnr"] = None  # JSON has no inf; sha_equal says it all
        return row
    b_frames = _load_frames(base.output_dir / f"{stem}{FRAMES_SUFFIX}", b_rec["frames_sha256"])
    c_frames = _load_frames(cand.output_dir / f"{stem}{FRAMES_SUFFIX}", c_rec["frames_sha256"])
    diff = frame_diff(b_frames, c_frames)
    row.update(
        max_abs=diff.max_abs,
        mean_abs=diff.mean_abs,
        psnr=None if math.isinf(diff.psnr) else diff.psnr,
        ssim=diff.ssim,
    )
    sheet = write_contact_sheet(
        b_frames,
        c_frames,
        out / CONTACT_DIR / f"{stem}.png",
        title=f"{stem}: baseline vs candidate (declared: {', '.join(declared) or 'nothing'})",
        rows=rows,
    )
    row["contact_sheet"] = str(sheet.relative_to(out))
    return row


def _prompt_following(
    scorer: PromptScorer,
    prompt: str,
    b_rec: dict[str, Any],
    c_rec: dict[str, Any],
    base: RenderPlan,
    cand: RenderPlan,
    stem: str,
) -> dict[str, Any]:
    """Each side's prompt-following score ('score' of the scorer's dict) and its full answer."""
    answers = {}
    for side, plan, rec in (("base", base, b_rec), ("candidate", cand, c_rec)):
        if side == "candidate" and c_rec["frames_sha256"] == b_rec["frames_sha256"]:
            answers[side] = answers["base"]  # the same frames score the same
            continue
        frames = _load_frames(plan.output_dir / f"{stem}{FRAMES_SUFFIX}", rec["frames_sha256"])
        answers[side] = scorer(frames, prompt)
    return {
        "base_prompt_following": answers["base"].get("score"),
        "candidate_prompt_following": answers["candidate"].get("score"),
        "prompt_following": answers,
    }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the jobs both sides finished: mean PSNR (finite ones) and SSIM, the denoise and job time
    ratios of the totals over the warm jobs (neither side's time includes start-up), and each side's
    mean prompt-following score (None where not measured)."""
    done = [row for row in rows if "error" not in row]
    warm = [row for row in done if not row.get("cold")]

    def mean(values: list[Any]) -> float | None:
        values = [v for v in values if v is not None]
        return float(np.mean(values)) if values else None

    def ratio(cand: str, base: str) -> float | None:
        pairs = [(row[cand], row[base]) for row in warm if row.get(cand) is not None and row.get(base)]
        return sum(c for c, _ in pairs) / sum(b for _, b in pairs) if pairs else None

    def spread(name: str) -> list[float] | None:
        """[smallest, largest] of the per-job ratios `name` over the warm jobs."""
        values = [row[name] for row in warm if row.get(name) is not None]
        return [min(values), max(values)] if values else None

    summary = {
        "jobs": len(done),
        "timed_jobs": len(warm),
        "psnr_mean": mean([row["psnr"] for row in done if not row["sha_equal"]]),
        "ssim_mean": mean([row.get("ssim") for row in done]),
        "denoise_ratio": ratio("candidate_denoise_s", "base_denoise_s"),
        "time_ratio": ratio("candidate_s", "base_s"),
        "denoise_ratio_range": spread("denoise_ratio"),
        "time_ratio_range": spread("time_ratio"),
        "base_prompt_following": mean([row.get("base_prompt_following") for row in done]),
        "candidate_prompt_following": mean([row.get("candidate_prompt_following") for row in done]),
    }
    summary["timing_warning"] = timing_warning(summary)
    return summary


def timing_warning(summary: dict[str, Any]) -> str | None:
    """Why the summary's time ratios cannot be read as a speed-up (too few or too noisy runs), or None."""
    timed = summary["timed_jobs"]
    if timed == 0:
        return None
    if timed < MIN_TIMED_JOBS:
        return (
            f"{timed} timed job{'s' if timed != 1 else ''}: too few to call a speed-up (no estimate of the "
            f"run-to-run spread); time at least {MIN_TIMED_JOBS} jobs"
        )
    for name in ("denoise_ratio_range", "time_ratio_range"):
        span = summary.get(name)
        if span and span[0] > 0 and span[1] / span[0] > NOISY_SPREAD:
            return (
                f"per-job {name.removesuffix('_range').replace('_', ' ')}s range {span[0]:.2f}x-{span[1]:.2f}x "
                f"(more than {NOISY_SPREAD:g}x apart): too noisy to call a speed-up (a busy machine, "
                "or an effect that differs by job)"
            )
    return None


def _load_frames(path: Path, expected_sha: str) -> np.ndarray:
    try:
        frames = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise MmgenError(f"{path}: cannot read the saved frames ({err})") from err
    if frames_sha256(frames) != expected_sha:
        raise MmgenError(f"{path}: frames do not hash to the manifest's frames_sha256 {expected_sha[:12]}...")
    return frames


def _number(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _summary_lines(summary: dict[str, Any] | None, startup: dict[str, Any] | None) -> list[str]:
    """The quality and speed over all jobs, and what warming each side cost (outside the timed jobs)."""
    lines = []
    if summary and summary["jobs"]:
        quality = f"psnr_mean {_number(summary['psnr_mean'], '.2f')} dB, ssim_mean {_number(summary['ssim_mean'], '.4f')}"
        follow = ""
        if summary["base_prompt_following"] is not None:
            follow = (
                f", prompt-following {summary['base_prompt_following']:.2f} (base) vs "
                f"{_number(summary['candidate_prompt_following'], '.2f')} (candidate)"
            )
        timed = summary.get("timed_jobs", summary["jobs"])
        cold = summary["jobs"] - timed
        left_out = (
            f" ({cold} cold job{'s' if cold != 1 else ''} left out: start-up in its time)" if cold else ""
        )
        lines.append(
            f"over {timed} warmed jobs{left_out}: denoise {_ratio(summary, 'denoise_ratio')}, "
            f"job {_ratio(summary, 'time_ratio')} of the baseline's time; over {summary['jobs']} "
            f"jobs: {quality}{follow}"
        )
        if summary.get("timing_warning"):
            lines.append(f"WARNING timings: {summary['timing_warning']}")
    for side, info in (startup or {}).items():
        if info is None:
            lines.append(f"{side}: not warmed (nothing to render, multi-rank, or --no-warmup)")
        elif info.get("warmup_s") is None:
            lines.append(f"{side}: warm-up of {info['job']} failed: {info.get('error')}")
        else:
            lines.append(
                f"{side}: model load {info['load_s']:.2f}s, warm-up render of {info['job']} "
                f"{info['warmup_s']:.2f}s (untimed)"
            )
    return lines


def _ratio(summary: dict[str, Any], name: str) -> str:
    """'0.52x (per job 0.50x-0.55x)': the ratio of the totals and the spread of the per-job ratios."""
    text = _number(summary[name], ".2f", "x")
    span = summary.get(f"{name}_range")
    if span and span[0] != span[1]:
        text += f" (per job {span[0]:.2f}x-{span[1]:.2f}x)"
    return text


def _peak(stages: dict[str, float] | None) -> str:
    """The largest per-stage peak (GiB), '-' when none was measured (off CUDA)."""
    return f"{max(stages.values()):.2f}" if stages else "-"


def format_report(report: dict[str, Any]) -> str:
    """The per-job table and a verdict line, as printed by `mmgen ab`."""
    scored = any("base_prompt_following" in row for row in report["jobs"])
    header = (
        *("job", "sha256", "max_abs", "mean_abs", "psnr_dB", "ssim"),
        *("base_denoise_s", "cand_denoise_s", "denoise_ratio", "base_s", "cand_s", "ratio"),
        *(("base_follow", "cand_follow") if scored else ()),
        *("base_GiB", "cand_GiB", "verdict"),
    )
    table = [header]
    for row in report["jobs"]:
        if "error" in row:
            table.append((row["job"], "error", *[""] * (len(header) - 3), row["error"]))
            continue
        equal = row["sha_equal"]
        table.append(
            (
                row["job"],
                "equal" if equal else "DIFFERENT",
                "-" if equal else str(row["max_abs"]),
                "-" if equal else f"{row['mean_abs']:.3g}",
                "-" if equal else ("inf" if row["psnr"] is None else f"{row['psnr']:.2f}"),
                "-" if equal else _number(row.get("ssim"), ".4f"),
                _number(row.get("base_denoise_s"), ".2f"),
                _number(row.get("candidate_denoise_s"), ".2f"),
                _number(row.get("denoise_ratio"), ".2f", "x"),
                f"{row['base_s']:.2f}",
                f"{row['candidate_s']:.2f}",
                _number(row["time_ratio"], ".2f", "x"),
                *(
                    (_number(row.get("base_prompt_following"), ".2f"),)
                    + (_number(row.get("candidate_prompt_following"), ".2f"),)
                    if scored
                    else ()
                ),
                _peak(row.get("base_peak_gib")),
                _peak(row.get("candidate_peak_gib")),
                row.get("verdict", ""),
            )
        )
    widths = [max(len(str(r[i])) for r in table) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table]
    declared = ", ".join(report["declared"]) or "nothing (self-comparison)"
    lines.insert(
        0, f"baseline {report['baseline']}  vs  candidate {report['candidate']}; declared: {declared}"
    )
    if report["refused"]:
        lines.append("REFUSED: the fingerprints differ beyond the declared variables:")
        for job, fields in report["undeclared_differences"].items():
            for key, (b, c) in fields.items():
                lines.append(f"  {job}: {key}: {b!r} (baseline) vs {c!r} (candidate)")
    elif report["failed_jobs"]:
        lines.append("failed jobs: " + ", ".join(report["failed_jobs"]))
    if not report["refused"]:
        same = sum(1 for row in report["jobs"] if row.get("sha_equal"))
        lines.append(f"{same} of {len(report['jobs'])} jobs SHA-identical")
        lines.extend(_summary_lines(report.get("summary"), report.get("startup")))
        if report["expect"]:
            met = "met" if report["expectation_met"] else "NOT met"
            lines.append(f"expectation {report['expect']}: {met} (over the jobs both sides finished)")
    return "\n".join(lines)
