"""`mmgen ab`: render the same jobs as a baseline and a candidate, and prove what changed.

The candidate is a second render file or the baseline plus `--set key=value` settings. Both must be
the same jobs (names, prompts, seeds, sizes, frame counts, negative prompts); what differs between
them is the *declared* variable set (for example {attention_backend} or {dtype}). After rendering,
each job's two environment fingerprints may differ only in the fields a declared variable may
change (DECLARED_FINGERPRINT_FIELDS); any other difference (torch version, thread count, TF32, GPU)
makes a bit-level comparison meaningless, so the A/B is refused and the fields are listed.

Per job it reports whether the frames sha256 match and, when not, max/mean absolute difference and
PSNR over the uint8 frames (from the lossless .frames.npy each side saves, never the lossy mp4), both
job times and their ratio. It writes ab_report.json and, for every job whose SHAs differ, a contact
sheet PNG.
"""

from __future__ import annotations

import fnmatch
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from mmgen.errors import MmgenError, ValidationError
from mmgen.outputs.locations import check_output_dir
from mmgen.outputs.writers import atomic_write_text, frames_sha256, remove_stale_temps
from mmgen.render.contact import write_contact_sheet
from mmgen.render.manifest import MANIFEST_NAME
from mmgen.render.metrics import frame_diff
from mmgen.render.runner import (
    FRAMES_SUFFIX,
    PipelineFactory,
    RenderSummary,
    exclusive_output_dir,
    load_pipeline,
    run_render,
)
from mmgen.render.schema import (
    RenderConfigError,
    RenderPlan,
    apply_overrides,
    build_plan,
    read_yaml_mapping,
)
from pipelines.loader import resolve_device, resolve_dtype

REPORT_NAME = "ab_report.json"
AB_LOCK_NAME = ".mmgen-ab.lock"
CONTACT_DIR = "contact"

# Fingerprint fields (dotted, fnmatch patterns) that each declared variable may legitimately change.
# Anything not listed for a declared variable must be equal on both sides.
DECLARED_FINGERPRINT_FIELDS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "attention_backend": ("attention_providers", "attention_providers.*"),
        # auto backend selection depends on dtype and device, so those may move the providers too.
        "dtype": ("dtype", "attention_providers", "attention_providers.*"),
        "device": ("device", "gpu", "attention_providers", "attention_providers.*"),
        # LoRAs: the fingerprint's "loras" identity (sha256, strength, experts, mode) may change.
        "lora": ("loras", "loras.*"),
        "lora_mode": ("loras.mode",),
        # several ranks per job: the self-attention site reports its exchange (e.g. 'sdpa:sdpa ulysses2')
        "parallel": ("attention_providers", "attention_providers.*"),
        # lossy accelerations change the numbers, never the environment: no fingerprint field
        "step_cache": (),
        "cfg_truncation": (),
        "accel": (),
    }
)
# --set keys that lay one job over several ranks (mmgen.parallel), not render-file settings:
# gpus = ranks per job; sp, ring and cfg_parallel as `mmgen generate` takes them.
PARALLEL_SETS = ("gpus", "sp", "ring", "cfg_parallel")

# Settings that define *which* jobs run; an A/B over different jobs compares nothing.
JOB_IDENTITY_FIELDS = ("name", "prompt", "seed", "height", "width", "num_frames", "negative_prompt", "task")


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
        b_args = {"name": b.name, "prompt": b.prompt, "seed": b.seed, **b.pipeline_kwargs()}
        c_args = {"name": c.name, "prompt": c.prompt, "seed": c.seed, **c.pipeline_kwargs()}
        for job, job_args in ((b, b_args), (c, c_args)):
            if job.image_sha256 is not None:  # the conditioning image by content
                job_args["image_sha256"] = job.image_sha256
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
) -> AbResult:
    """Render baseline and candidate (fresh, or reusing finished jobs with reuse=True) and compare them."""
    expectation = Expectation.parse(expect)
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
    with exclusive_output_dir(out, lock_name=AB_LOCK_NAME, holder="ab"):
        start_comparison(out, reuse=reuse, sides=(base.output_dir, cand.output_dir))
        summaries = {
            "base": run_render(
                base,
                resume=reuse,
                save_frames=True,
                show_progress=show_progress,
                pipeline_factory=factory,
                replace_others=True,  # OUT belongs to this comparison: a new candidate replaces the old
            )
        }
        if parallel is None:
            summaries["candidate"] = run_render(
                cand,
                resume=reuse,
                save_frames=True,
                show_progress=show_progress,
                pipeline_factory=factory,
                replace_others=True,
            )
        else:
            from mmgen.render.groups import run_render_groups

            summaries["candidate"] = run_render_groups(cand, parallel, 1, resume=reuse, save_frames=True)
        report = compare(base, cand, summaries, declared, out, expectation, rows=rows)
        report["candidate_sets"] = list(sets)
        report_path = atomic_write_text(out / REPORT_NAME, json.dumps(report, indent=2, default=str) + "\n")
    return AbResult(report=report, report_path=report_path, exit_code=report["exit_code"])


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
    import yaml

    from mmgen.parallel.layout import ParallelConfig

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
    row: dict[str, Any] = {
        "sha_equal": b_rec["frames_sha256"] == c_rec["frames_sha256"],
        "base_frames_sha256": b_rec["frames_sha256"],
        "candidate_frames_sha256": c_rec["frames_sha256"],
        "latents_sha_equal": b_rec["latents_sha256"] == c_rec["latents_sha256"],
        "max_abs": 0,
        "mean_abs": 0.0,
        "psnr": math.inf,
        "base_s": b_time,
        "candidate_s": c_time,
        "time_ratio": c_time / b_time if b_time > 0 else None,
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
        max_abs=diff.max_abs, mean_abs=diff.mean_abs, psnr=None if math.isinf(diff.psnr) else diff.psnr
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


def _load_frames(path: Path, expected_sha: str) -> np.ndarray:
    try:
        frames = np.load(io.BytesIO(path.read_bytes()), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise MmgenError(f"{path}: cannot read the saved frames ({err})") from err
    if frames_sha256(frames) != expected_sha:
        raise MmgenError(f"{path}: frames do not hash to the manifest's frames_sha256 {expected_sha[:12]}...")
    return frames


def _peak(stages: dict[str, float] | None) -> str:
    """The largest per-stage peak (GiB), '-' when none was measured (off CUDA)."""
    return f"{max(stages.values()):.2f}" if stages else "-"


def format_report(report: dict[str, Any]) -> str:
    """The per-job table and a verdict line, as printed by `mmgen ab`."""
    header = (
        *("job", "sha256", "max_abs", "mean_abs", "psnr_dB", "base_s", "cand_s", "ratio"),
        *("base_GiB", "cand_GiB", "verdict"),
    )
    table = [header]
    for row in report["jobs"]:
        if "error" in row:
            table.append((row["job"], "error", "", "", "", "", "", "", "", "", row["error"]))
            continue
        equal = row["sha_equal"]
        table.append(
            (
                row["job"],
                "equal" if equal else "DIFFERENT",
                "-" if equal else str(row["max_abs"]),
                "-" if equal else f"{row['mean_abs']:.3g}",
                "-" if equal else ("inf" if row["psnr"] is None else f"{row['psnr']:.2f}"),
                f"{row['base_s']:.2f}",
                f"{row['candidate_s']:.2f}",
                "-" if row["time_ratio"] is None else f"{row['time_ratio']:.2f}x",
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
        if report["expect"]:
            met = "met" if report["expectation_met"] else "NOT met"
            lines.append(f"expectation {report['expect']}: {met} (over the jobs both sides finished)")
    return "\n".join(lines)
