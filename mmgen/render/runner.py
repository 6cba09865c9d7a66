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
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np

from mmgen.errors import MmgenError
from mmgen.outputs.writers import atomic_write_bytes, remove_stale_temps, write_png, write_video
from mmgen.progress import NullProgress, ProgressReporter, TqdmProgress
from mmgen.render.manifest import (
    MANIFEST_NAME,
    RECORD_SCHEMA,
    append_record,
    file_sha256,
    latest_by_key,
    outputs_intact,
    read_manifest,
    repair_manifest,
)
from mmgen.render.schema import JobSpec, RenderPlan
from pipelines.loader import load_pipeline as _load
from pipelines.loader import resolve_device, resolve_dtype

JOB_START_HOOK_ENV = "MMGEN_RENDER_JOB_START_FILE"
LOCK_NAME = ".mmgen-render.lock"
FRAMES_SUFFIX = ".frames.npy"

# A loaded pipeline: called as pipe(prompt, **kwargs) and returning a GenerationResult.
Pipeline = Callable[..., Any]
PipelineFactory = Callable[[RenderPlan], Pipeline]


@dataclass(frozen=True)
class JobOutcome:
    """What happened to one job in this run."""

    job: JobSpec
    status: Literal["rendered", "skipped", "failed"]
    seconds: float
    error: str | None = None
    record: dict[str, Any] | None = None


@dataclass(frozen=True)
class RenderSummary:
    """The result of a run: per-job outcomes, whether a model was loaded and how long it took."""

    output_dir: Path
    outcomes: tuple[JobOutcome, ...]
    model_loaded: bool
    load_seconds: float
    removed_temps: tuple[Path, ...] = field(default=())

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
        return "\n".join(lines)


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
) -> RenderSummary:
    """Render every job of `plan` not already done (all of them when resume=False).

    save_frames also stores each job's raw uint8 frames as <stem>.frames.npy (lossless; `mmgen ab`
    compares those). show_progress None shows bars only on a terminal.
    """
    plan.output_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_output_dir(plan.output_dir):
        return _run_locked(plan, resume, save_frames, show_progress, pipeline_factory, log)


@contextlib.contextmanager
def exclusive_output_dir(directory: Path) -> Iterator[None]:
    """Hold an flock on DIR/.mmgen-render.lock: one render per output directory at a time.

    Needed because a run deletes leftover temp files, which must never be another live run's. The
    kernel drops the lock when the process dies, so a SIGKILLed run never blocks the next one.
    """
    import fcntl

    with open(directory / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MmgenError(f"{directory}: another mmgen render is writing to this directory") from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _run_locked(
    plan: RenderPlan,
    resume: bool,
    save_frames: bool,
    show_progress: bool | None,
    pipeline_factory: PipelineFactory | None,
    log: Callable[[str], None] | None,
) -> RenderSummary:
    from tqdm.auto import tqdm

    output_dir = plan.output_dir
    removed = tuple(remove_stale_temps(output_dir))
    manifest = output_dir / MANIFEST_NAME
    repair_manifest(manifest)
    if resume:
        pending, done = pending_jobs(plan, output_dir)
    else:
        pending, done = list(plan.jobs), {}
    pending_set = {job.label for job in pending}
    outcomes: dict[str, JobOutcome] = {
        job.label: JobOutcome(job, "skipped", 0.0, record=done[job.label])
        for job in plan.jobs
        if job.label not in pending_set
    }
    disable = None if show_progress is None else not show_progress
    load_seconds = 0.0
    if pending:
        factory = pipeline_factory or load_pipeline
        start = time.perf_counter()
        pipe = factory(plan)
        load_seconds = time.perf_counter() - start
        if log is not None:
            log(
                f"loaded {plan.model} in {load_seconds:.2f}s; {len(pending)} of {len(plan.jobs)} jobs to render"
            )
        overall = tqdm(
            total=len(plan.jobs), initial=len(done), desc="jobs", unit="job", disable=disable, position=0
        )
        try:
            for job in pending:
                overall.set_postfix_str(job.label)
                outcome = _run_job(plan, job, pipe, manifest, save_frames=save_frames, disable=disable)
                outcomes[job.label] = outcome
                overall.update(1)
        finally:
            overall.close()
    return RenderSummary(
        output_dir=output_dir,
        outcomes=tuple(outcomes[job.label] for job in plan.jobs),
        model_loaded=bool(pending),
        load_seconds=load_seconds,
        removed_temps=removed,
    )


def _run_job(
    plan: RenderPlan, job: JobSpec, pipe: Pipeline, manifest: Path, *, save_frames: bool, disable: bool | None
) -> JobOutcome:
    _announce_job_start(job)
    base_record = {
        "schema": RECORD_SCHEMA,
        "job": {"index": job.index, "name": job.name, "label": job.label, "stem": job.stem},
        "request_key": plan.request_key(job),
        "request": {
            "prompt": job.prompt,
            "seed": job.seed,
            **job.pipeline_kwargs(),
            **({} if job.image_sha256 is None else {"image_sha256": job.image_sha256}),
        },
        "config": str(plan.source),
        "model": plan.model,
        "task": plan.task,
    }
    progress = _job_progress(job, disable)
    start = time.perf_counter()
    try:
        result = pipe(job.prompt, seed=job.seed, progress=progress, **job.pipeline_kwargs())
        _synchronize(plan)
        generated = time.perf_counter()
        progress.stage("export", 2 if save_frames else 1)
        fps = plan.fps if plan.fps is not None else int(result.args.get("fps", 16))
        outputs = _export(plan, job, result.frames, fps=fps, save_frames=save_frames, progress=progress)
        finished = time.perf_counter()
        timings = {**dict(result.timings), "export": finished - generated, "job": finished - start}
        record = {
            **base_record,
            "status": "ok",
            "args": dict(result.args),
            "outputs": outputs,
            "frames_sha256": result.frames_sha256,
            "latents_sha256": result.latents_sha256,
            "frames_shape": list(np.asarray(result.frames).shape),
            "timings": timings,
            "memory_gib": dict(getattr(result, "memory", {})),  # peak GPU memory per stage
            "fingerprint": dict(result.fingerprint),
            "attention_providers": dict(result.attention_providers),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
    except Exception as err:  # a failed job is recorded and the batch goes on
        seconds = time.perf_counter() - start
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not isinstance(err, MmgenError):
            message = f"{type(err).__name__}: {message}"
        record = {
            **base_record,
            "status": "failed",
            "error": message,
            "traceback": None if isinstance(err, MmgenError) else traceback.format_exc(limit=8),
            "timings": {"job": seconds},
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        append_record(manifest, record)
        return JobOutcome(job, "failed", seconds, error=message, record=record)
    finally:
        progress.close()
    append_record(manifest, record)
    return JobOutcome(job, "rendered", record["timings"]["job"], record=record)


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
    if plan.task == "t2i":
        path = write_png(frames[0], directory / f"{job.stem}.png")
        outputs.append({"path": path.name, "kind": "png"})
    else:
        path = write_video(frames, directory / f"{job.stem}.mp4", fps=fps)
        outputs.append({"path": path.name, "kind": "mp4", "frames": int(frames.shape[0]), "fps": fps})
    progress.advance()
    if save_frames:
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(frames), allow_pickle=False)
        raw = atomic_write_bytes(directory / f"{job.stem}{FRAMES_SUFFIX}", buffer.getvalue())
        outputs.append({"path": raw.name, "kind": "frames"})
        progress.advance()
    for output in outputs:
        file = directory / output["path"]
        output["sha256"] = file_sha256(file)
        output["bytes"] = file.stat().st_size
    return outputs


def _announce_job_start(job: JobSpec) -> None:
    hook = os.environ.get(JOB_START_HOOK_ENV)
    if hook:
        with open(hook, "a", encoding="utf-8") as fh:
            fh.write(f"{job.index} {job.label}\n")
            fh.flush()
            os.fsync(fh.fileno())


def _job_progress(job: JobSpec, disable: bool | None) -> ProgressReporter:
    # A per-job bar (denoise steps, decode, export) under the bar over jobs; none when bars are off.
    if disable is None:
        disable = not sys.stderr.isatty()
    return NullProgress() if disable else TqdmProgress(desc=job.label, position=1, leave=False)


def _synchronize(plan: RenderPlan) -> None:
    # CUDA work is asynchronous: wait for it so the job time covers finished work.
    import torch

    if torch.cuda.is_available() and plan.device != "cpu":
        torch.cuda.synchronize()


def load_pipeline(plan: RenderPlan) -> Pipeline:
    """Load the plan's model once (the embedded default when model is 'default')."""
    device = resolve_device(plan.device)
    # Jobs that offload or plan within a GPU budget need the weights loaded on the host first.
    offloading = any(
        job.pipeline_kwargs().get("offload") in ("model", "layer")
        or job.pipeline_kwargs().get("gpu_memory_gb")
        for job in plan.jobs
    )
    return _load(
        plan.model,
        task=plan.task,
        device=device,
        dtype=resolve_dtype(plan.dtype, device),
        load_on_host=offloading or None,
    )


def print_summary(summary: RenderSummary) -> None:
    print(summary.format(), file=sys.stdout, flush=True)
