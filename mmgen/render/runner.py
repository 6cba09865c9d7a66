"""Run a RenderPlan: one model load, every pending job rendered, written atomically and recorded.

Crash safety, step by step for each job: render -> write the outputs (temp file, fsync, rename) ->
append one complete manifest line (fsync). A kill before the rename loses only this job (its temp
file is deleted by the next run); a kill between the rename and the append leaves an output without
a record, which the next run renders again and replaces atomically. A job counts as done when the
latest manifest record for its request key says "ok" and every output it lists still exists with the
recorded byte hash; anything else is rendered (again).

Test hook: when the environment variable MMGEN_RENDER_JOB_START_FILE names a file, the runner
appends one line "<index> <label>" to it as each job starts (and changes nothing else), so a test can
kill a render at a known point.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm.auto import tqdm

from mmgen.errors import MmgenError, one_line
from mmgen.executors.in_process import JOB_START_HOOK_ENV, InProcessExecutor
from mmgen.executors.in_process import load_pipeline as load_model
from mmgen.executors.jobs import JobSpec, RenderedJob
from mmgen.executors.protocol import Executor, Pipeline
from mmgen.outputs import locations
from mmgen.outputs.locations import OutputLocationError, check_free_space, estimate_output_bytes
from mmgen.outputs.writers import (
    OutputWriteError,
    atomic_write_bytes,
    file_sha256,
    remove_stale_temps,
    write_png,
    write_video,
)
from mmgen.progress import NullProgress, ProgressReporter
from mmgen.render.manifest import (
    MANIFEST_NAME,
    RECORD_SCHEMA,
    append_record,
    latest_by_key,
    outputs_intact,
    read_manifest,
    repair_manifest,
)
from mmgen.render.schema import RenderPlan
from pipelines.request import GenerationRequest

# Re-exported: the test hook is imported from here by ab and tests.
__all__ = ["JOB_START_HOOK_ENV", "Pipeline", "PipelineFactory", "load_pipeline", "run_render"]

PipelineFactory = Callable[[RenderPlan], Pipeline]  # loads a render's one pipeline in this process
# Builds the executor for a plan's pending jobs (run_render calls it only when a job is pending).
ExecutorFactory = Callable[[RenderPlan], Executor]

LOCK_NAME = ".mmgen-render.lock"
FRAMES_SUFFIX = ".frames.npy"


@dataclass(frozen=True)
class JobOutcome:
    """What happened to one job in this run."""

    job: JobSpec
    status: Literal["rendered", "skipped", "failed"]
    seconds: float
    error: str | None = None
    record: dict[str, Any] | None = None


@dataclass(frozen=True)
class ReplicaUsage:
    """One replica's share of a run: jobs it returned, seconds it spent rendering them (its busy
    time: the pipeline calls, not the driver's export), and LoRA sets it read and applied."""

    name: str
    jobs: int = 0
    busy_s: float = 0.0
    lora_loads: int = 0

    def add(self, rendered: RenderedJob) -> ReplicaUsage:
        busy = self.busy_s + float(rendered.timings.get("render", 0.0))
        return ReplicaUsage(self.name, self.jobs + 1, busy, self.lora_loads + rendered.lora_loads)

    def format(self) -> str:
        return f"{self.name}: {self.jobs} jobs, busy {self.busy_s:.2f}s, {self.lora_loads} LoRA loads"


@dataclass(frozen=True)
class RenderSummary:
    """The result of a run: per-job outcomes, whether a model was loaded and how long it took."""

    output_dir: Path
    outcomes: tuple[JobOutcome, ...]
    model_loaded: bool
    load_seconds: float
    removed_temps: tuple[Path, ...] = field(default=())
    # Repairs this run made (a partial manifest line dropped, a damaged output rendered again).
    notes: tuple[str, ...] = field(default=())
    # Where this run's jobs ran: per replica (or 'local'), in the order each first finished a job.
    replicas: tuple[ReplicaUsage, ...] = field(default=())

    @property
    def failed(self) -> tuple[JobOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status == "failed")

    @property
    def rendered(self) -> tuple[JobOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status == "rendered")

    @property
    def skipped(self) -> tuple[JobOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status == "skipped")

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def format(self) -> str:
        """A table of the jobs (status, time, output) and a line naming any failures."""
        rows = [("job", "seed", "status", "time", "output")]
        for o in self.outcomes:
            output = ""
            if o.record and o.record.get("outputs"):
                output = o.record["outputs"][0]["path"]
            time_text = "-" if o.status == "skipped" else f"{o.seconds:.2f}s"
            rows.append(
                (
                    o.job.label,
                    str(o.job.seed),
                    o.status,
                    time_text,
                    output if o.status != "failed" else o.error or "",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            for r in rows
        ]
        load = (
            f"model loaded in {self.load_seconds:.2f}s"
            if self.model_loaded
            else "no model load (nothing to render)"
        )
        lines.append(
            f"{len(self.rendered)} rendered, {len(self.skipped)} already done, {len(self.failed)} failed; {load}; "
            f"output: {self.output_dir}"
        )
        if self.failed:
            lines.append("failed: " + ", ".join(f"{o.job.label} ({o.error})" for o in self.failed))
        if any(usage.name != "local" for usage in self.replicas):
            lines += [f"replica {usage.format()}" for usage in self.replicas]
        return "\n".join([*(f"note: {note}" for note in self.notes), *lines])


def load_pipeline(plan: RenderPlan) -> Pipeline:
    """The plan's pipeline, loaded once in this process (the embedded default when model is 'default')."""
    return load_model(plan.model_spec())


def pending_jobs(plan: RenderPlan, output_dir: Path) -> tuple[list[JobSpec], dict[str, dict[str, Any]]]:
    """Jobs that still need rendering, and the finished records of the others (by label)."""
    latest = latest_by_key(read_manifest(output_dir / MANIFEST_NAME))
    pending, done = [], {}
    for job in plan.jobs:
        record = latest.get(plan.request_key(job))
        if record is not None and record.get("status") == "ok" and outputs_intact(record, output_dir):
            done[job.label] = record
        else:
            pending.append(job)
    return pending, done


def run_render(
    plan: RenderPlan,
    *,
    resume: bool = True,
    save_frames: bool = False,
    show_progress: bool | None = None,
    pipeline_factory: PipelineFactory | None = None,
    log: Callable[[str], None] | None = None,
    replace_others: bool = False,
    warmed: bool = False,
    executor: ExecutorFactory | None = None,
) -> RenderSummary:
    """Render every job of `plan` not already done (all of them when resume=False).

    save_frames also stores each job's raw uint8 frames as <stem>.frames.npy (lossless; `mmgen ab`
    compares those). show_progress None shows bars only on a terminal. Every output location is
    checked before the model loads (check_outputs); an output the manifest attributes to a different
    request is refused unless resume=False or replace_others=True. A read-only output directory
    whose jobs are all done is reported as done, without taking the lock.
    warmed: the caller has already run this pipeline once, untimed (`mmgen ab`'s warm-up). Otherwise
    the first job rendered here pays the start-up (first kernels, caches) and its record's timings
    say so ('cold': true), so time comparisons can leave it out.
    executor: builds where the pending jobs run (mmgen.executors); None = this process, with
    pipeline_factory's pipeline. Wherever they run, this process writes every output and record.
    """
    output_dir = plan.output_dir
    if output_dir.is_dir() and not locations.is_writable(output_dir):
        return _read_only_summary(plan, resume)
    locations.check_output_dir(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputLocationError(
            f"{output_dir}: cannot create the output directory ({err.strerror})"
        ) from err
    with exclusive_output_dir(output_dir):
        return _run_locked(
            plan, resume, save_frames, show_progress, pipeline_factory, log, replace_others, warmed, executor
        )


def _read_only_summary(plan: RenderPlan, resume: bool) -> RenderSummary:
    # Read-only media (an archive, a mounted result): fine to look at when nothing is left to do.
    pending, done = pending_jobs(plan, plan.output_dir) if resume else (list(plan.jobs), {})
    if pending:
        raise OutputLocationError(
            f"{plan.output_dir}: not writable (read-only filesystem or no permission); "
            f"{len(pending)} of {len(plan.jobs)} jobs still to render"
        )
    return RenderSummary(
        output_dir=plan.output_dir,
        outcomes=tuple(JobOutcome(job, "skipped", 0.0, record=done[job.label]) for job in plan.jobs),
        model_loaded=False,
        load_seconds=0.0,
    )


def job_output_names(plan: RenderPlan, job: JobSpec, *, save_frames: bool) -> list[str]:
    """The file names a job writes into the output directory (the one place they are spelled)."""
    names = [f"{job.stem}{plan.output_suffix}"]
    if save_frames:
        names.append(f"{job.stem}{FRAMES_SUFFIX}")
    return names


def check_outputs(
    plan: RenderPlan,
    pending: list[JobSpec],
    records: list[dict[str, Any]],
    *,
    save_frames: bool,
    replace_others: bool,
) -> None:
    """Before the model loads: no directory at any pending output path, no output of another request
    overwritten (unless replace_others), and room on the disk for the first job's outputs."""
    directory = plan.output_dir
    owners: dict[str, dict[str, Any]] = {}  # output name -> the latest ok record that wrote it
    for record in records:
        if record.get("status") == "ok" and isinstance(record.get("outputs"), list):
            for output in record["outputs"]:
                if isinstance(output, dict) and isinstance(output.get("path"), str):
                    owners[output["path"]] = record
    blocked, foreign = [], []
    for job in pending:
        for name in job_output_names(plan, job, save_frames=save_frames):
            path = directory / name
            if path.exists() and not path.is_file():
                blocked.append(f"{name} (job {job.label})")
            owner = owners.get(name)
            if (
                not replace_others
                and path.is_file()
                and owner is not None
                and owner.get("request_key") != plan.request_key(job)
            ):
                request = owner.get("request") if isinstance(owner.get("request"), dict) else {}
                foreign.append(
                    f"{name} (job {job.label}) was rendered by {owner.get('config')} for prompt "
                    f"{request.get('prompt')!r}; changed: {changed_fields(plan, job, owner)}"
                )
    if blocked:
        raise OutputLocationError(
            f"{directory}: a directory (or other non-file) is in the way of {len(blocked)} output"
            f"{'s' if len(blocked) != 1 else ''}: {', '.join(blocked)}"
        )
    if foreign:
        raise OutputLocationError(
            f"{directory}: refusing to overwrite outputs of a different request: {'; '.join(foreign)} "
            "(use another --out or different job names, or --no-resume to replace them)"
        )
    if pending:
        first = pending[0]
        height, width = first.request.height, first.request.width
        if height is not None and width is not None:  # else the model's defaults decide
            frames = 1 if plan.task == "t2i" else first.request.num_frames
            if frames is not None:
                needed = sum(
                    estimate_output_bytes(Path(name).suffix, frames, height, width)
                    for name in job_output_names(plan, first, save_frames=save_frames)
                )
                check_free_space(directory, needed, what=f"job {first.label}")


def changed_fields(plan: RenderPlan, job: JobSpec, record: dict[str, Any]) -> str:
    """What differs between the request (and run settings) a manifest record names and `job`'s now:
    'height 32 -> 48, seed 1 -> 2'. A field a record leaves out had its default (older records list
    only the fields their file set)."""
    if not _mapping(record.get("request")):
        return "fields not recorded"
    defaults = GenerationRequest.model_construct(prompt="").record()
    old = {**defaults, **_mapping(record.get("settings")), **_mapping(record.get("request"))}
    new = {**plan.settings(), **job.request.record()}
    names = [name for name in new if name in old and old[name] != new[name]]
    names += [name for name in old if name not in new]  # a setting that is gone
    if not names:  # the same request and settings: the key differs in something else (a LoRA file's bytes)
        return "the request key (the same fields; a file they name changed)"
    return ", ".join(f"{name} {old.get(name)!r} -> {new.get(name)!r}" for name in names)


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@contextlib.contextmanager
def exclusive_output_dir(
    directory: Path, *, lock_name: str = LOCK_NAME, holder: str = "render"
) -> Iterator[None]:
    """Hold an flock on DIR/<lock_name>: one render (or one `ab`) per output directory at a time.

    Needed because a run deletes leftover temp files, which must never be another live run's. The
    kernel drops the lock when the process dies, so a SIGKILLed run never blocks the next one.
    """
    import fcntl  # POSIX only: imported where the lock is taken

    try:
        handle = open(directory / lock_name, "a+")  # noqa: SIM115 (closed below, after the unlock)
    except OSError as err:
        raise OutputLocationError(
            f"{directory}: cannot create the lock file {lock_name} ({err.strerror})"
        ) from err
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MmgenError(f"{directory}: another mmgen {holder} is writing to this directory") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@dataclass(frozen=True)
class RunStart:
    """What a run found in its locked output directory before rendering anything (see start_run)."""

    removed_temps: tuple[Path, ...]
    pending: list[JobSpec]
    done: dict[str, dict[str, Any]]  # label -> the finished record of a job not rendered again
    notes: tuple[str, ...]  # repairs: a partial manifest line dropped, a damaged output rendered again


def start_run(plan: RenderPlan, *, resume: bool, save_frames: bool, replace_others: bool) -> RunStart:
    """Under the output directory's lock, before any model loads (one process or groups alike):
    remove stale temps, repair the manifest, pick the pending jobs and check their output locations."""
    output_dir = plan.output_dir
    removed = tuple(remove_stale_temps(output_dir))
    manifest = output_dir / MANIFEST_NAME
    notes = []
    dropped = repair_manifest(manifest)
    if dropped:
        notes.append(
            f"{manifest}: removed {dropped} partial line{'s' if dropped != 1 else ''} (an interrupted run)"
        )
    records = read_manifest(manifest)
    if resume:
        pending, done = pending_jobs(plan, output_dir)
        latest = latest_by_key(records)
        for job in pending:
            record = latest.get(plan.request_key(job))
            if record is not None and record.get("status") == "ok":
                notes.append(f"{job.label}: its finished output is missing or damaged; rendering it again")
    else:
        pending, done = list(plan.jobs), {}
    check_outputs(
        plan, pending, records, save_frames=save_frames, replace_others=replace_others or not resume
    )
    return RunStart(removed, pending, done, tuple(notes))


def _run_locked(
    plan: RenderPlan,
    resume: bool,
    save_frames: bool,
    show_progress: bool | None,
    pipeline_factory: PipelineFactory | None,
    log: Callable[[str], None] | None,
    replace_others: bool,
    warmed: bool,
    executor: ExecutorFactory | None = None,
) -> RenderSummary:
    output_dir = plan.output_dir
    manifest = output_dir / MANIFEST_NAME
    found = start_run(plan, resume=resume, save_frames=save_frames, replace_others=replace_others)
    pending, done = found.pending, found.done
    pending_set = {job.label for job in pending}
    outcomes: dict[str, JobOutcome] = {
        job.label: JobOutcome(job, "skipped", 0.0, record=done[job.label])
        for job in plan.jobs
        if job.label not in pending_set
    }
    disable = None if show_progress is None else not show_progress
    load_seconds = 0.0
    usage: dict[str, ReplicaUsage] = {}
    if pending:
        if executor is None:
            factory = pipeline_factory or load_pipeline
            chosen: Executor = InProcessExecutor(
                plan.model_spec(), lambda: factory(plan), show_progress=show_progress, warmed=warmed
            )
        else:
            chosen = executor(plan)
        by_index = {job.index: job for job in pending}
        with chosen:
            load_seconds = chosen.load_seconds
            if log is not None:
                log(
                    f"loaded {plan.model} in {load_seconds:.2f}s; {len(pending)} of {len(plan.jobs)} jobs to render"
                )
            overall = tqdm(
                total=len(plan.jobs), initial=len(done), desc="jobs", unit="job", disable=disable, position=0
            )
            try:
                _write_all(
                    plan, chosen.run(pending), by_index, manifest, outcomes, overall, save_frames, usage
                )
            finally:
                overall.close()
            load_seconds = chosen.load_seconds
    return RenderSummary(
        output_dir=output_dir,
        outcomes=tuple(outcomes[job.label] for job in plan.jobs),
        model_loaded=bool(pending),
        load_seconds=load_seconds,
        removed_temps=found.removed_temps,
        notes=found.notes,
        replicas=tuple(usage.values()),
    )


def _write_all(
    plan: RenderPlan,
    results: Iterator[RenderedJob],
    by_index: dict[int, JobSpec],
    manifest: Path,
    outcomes: dict[str, JobOutcome],
    overall: Any,
    save_frames: bool,
    usage: dict[str, ReplicaUsage],
) -> None:
    """The driver's half: write and record each job an executor gives back, in the order they finish,
    adding each to its replica's usage (a job the executor failed without running is not counted).

    After a full disk every later job would render in vain and fail the same way: they are recorded
    as not started and the executor is closed (the caller's `with`) without running them."""
    disk_full: str | None = None
    try:
        for rendered in results:
            job = by_index[rendered.index]
            if rendered.timings:
                usage[rendered.replica] = usage.get(rendered.replica, ReplicaUsage(rendered.replica)).add(
                    rendered
                )
            overall.set_postfix_str(job.label)
            outcome, full = write_job(plan, job, rendered, manifest, save_frames=save_frames)
            outcomes[job.label] = outcome
            overall.update(1)
            if full:
                disk_full = f"disk full at job {job.label}"
                break
    finally:
        close = getattr(results, "close", None)
        if close is not None:
            close()
    if disk_full is not None:
        for job in by_index.values():
            if job.label not in outcomes:
                outcomes[job.label] = JobOutcome(job, "failed", 0.0, error=f"not started: {disk_full}")


def write_job(
    plan: RenderPlan, job: JobSpec, rendered: RenderedJob, manifest: Path, *, save_frames: bool
) -> tuple[JobOutcome, bool]:
    """Write one rendered job's outputs atomically and append its record (or record its failure);
    returns its outcome and whether the disk filled up. Only the driver calls this."""
    # Where it ran and the LoRA sets it loaded there: with timings (job - export = the replica's
    # busy time), each replica's share of a render can be summed from the manifest.
    base_record = {**_base_record(plan, job), "replica": rendered.replica, "lora_loads": rendered.lora_loads}
    progress = rendered.progress or NullProgress()
    render_seconds = float(rendered.timings.get("render", 0.0))
    timings = {name: value for name, value in rendered.timings.items() if name != "render"}
    error, trace, full = rendered.error, rendered.traceback, False
    record: dict[str, Any] = {}
    if error is None and rendered.frames is not None:
        started = time.perf_counter()
        try:
            progress.stage("export", 2 if save_frames else 1)
            outputs = _export(
                plan, job, rendered.frames, fps=rendered.fps or 16, save_frames=save_frames, progress=progress
            )
        except Exception as err:  # a failed export is a failed job: recorded, and the batch goes on
            error = one_line(err, typed=True)
            trace = None if isinstance(err, MmgenError) else traceback.format_exc(limit=8)
            full = isinstance(err, OutputWriteError) and err.disk_full
            render_seconds += time.perf_counter() - started
        else:
            export = time.perf_counter() - started
            record = {
                **base_record,
                "status": "ok",
                "args": rendered.args,
                "outputs": outputs,
                "frames_sha256": rendered.frames_sha256,
                "latents_sha256": rendered.latents_sha256,
                "frames_shape": list(rendered.frames.shape),
                "timings": {**timings, "export": export, "job": render_seconds + export},
                "memory_gib": rendered.memory_gib,  # peak GPU memory per stage
                "fingerprint": rendered.fingerprint,
                "attention_providers": rendered.attention_providers,
                "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            }
    elif error is None:
        error = "the replica returned no frames"
    if error is not None:
        record = {
            **base_record,
            "status": "failed",
            "error": error,
            "traceback": trace,
            "timings": {"job": render_seconds},
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    try:
        append_record(manifest, record)
    except OutputWriteError as err:
        if error is not None:  # the failure stands; it just goes unrecorded
            return JobOutcome(
                job, "failed", render_seconds, error=f"{error}; not recorded: {err}", record=record
            ), (full or err.disk_full)
        # The outputs are in place but unrecorded: the next run renders this job again.
        return JobOutcome(
            job, "failed", record["timings"]["job"], error=f"rendered but not recorded: {err}"
        ), err.disk_full
    if error is not None:
        return JobOutcome(job, "failed", render_seconds, error=error, record=record), full
    return JobOutcome(job, "rendered", record["timings"]["job"], record=record), False


def _base_record(plan: RenderPlan, job: JobSpec) -> dict[str, Any]:
    """The manifest fields of a job's record that do not depend on how it went."""
    return {
        "schema": RECORD_SCHEMA,
        "job": {"index": job.index, "name": job.name, "label": job.label, "stem": job.stem},
        "request_key": plan.request_key(job),
        "request": job.request.record(),  # every field (changed_fields diffs it on a rerun)
        "settings": plan.settings(),
        "config": str(plan.source),
        "model": plan.model,
        "task": plan.task,
    }


def _export(
    plan: RenderPlan,
    job: JobSpec,
    frames: np.ndarray,
    *,
    fps: int,
    save_frames: bool,
    progress: ProgressReporter,
) -> list[dict[str, Any]]:
    """Write the job's outputs atomically; returns their manifest entries (paths relative to the dir)."""
    directory = plan.output_dir
    frames = np.asarray(frames)
    outputs = []
    names = job_output_names(plan, job, save_frames=save_frames)
    if plan.task == "t2i":
        path = write_png(frames[0], directory / names[0])
        outputs.append({"path": path.name, "kind": "png"})
    else:
        path = write_video(frames, directory / names[0], fps=fps)
        outputs.append({"path": path.name, "kind": "mp4", "frames": int(frames.shape[0]), "fps": fps})
    progress.advance()
    if save_frames:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(frames), allow_pickle=False)
        raw = atomic_write_bytes(directory / names[1], buffer.getvalue())
        outputs.append({"path": raw.name, "kind": "frames"})
        progress.advance()
    for output in outputs:
        file = directory / output["path"]
        output["sha256"] = file_sha256(file)
        output["bytes"] = file.stat().st_size
    return outputs


def print_summary(summary: RenderSummary) -> None:
    print(summary.format(), file=sys.stdout, flush=True)
