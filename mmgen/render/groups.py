"""`mmgen render FILE --gpus N [--sp S] [--ring R] [--cfg-parallel]`: groups of ranks pulling jobs from one queue.

N GPUs (CPU: gloo processes) form N / G groups of G = S x (2 with --cfg-parallel) ranks; each group
is its own torch.distributed world running one job at a time over its ranks (sequence / CFG
parallel inside the group). The launcher, holding the output directory's lock, puts every pending
job on one queue; each group's rank 0 takes the next job when it is free (a slow job never stalls
the other groups), hands it to its ranks, and alone writes the outputs and appends the manifest
record exactly as a one-process render does (runner._run_job: outputs renamed into place, then one
complete fsynced line). Each job is taken from the queue once, so each finished job is recorded
once. A kill stops every worker (they die with the launcher) and a rerun, with any group count,
resumes from the manifest like a one-process render.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import torch.distributed as dist

from mmgen.errors import ValidationError
from mmgen.parallel.launch import run_worlds
from mmgen.parallel.layout import ParallelConfig, ParallelLayout
from mmgen.render.manifest import MANIFEST_NAME, latest_by_key, read_manifest
from mmgen.render.runner import (
    JobOutcome,
    RenderSummary,
    _run_job,
    exclusive_output_dir,
    load_pipeline,
    start_run,
)
from mmgen.render.schema import RenderPlan
from pipelines.loader import resolve_device


def render_groups(gpus: int, sp: int | None, ring: int, cfg: bool) -> tuple[ParallelConfig, int]:
    """(each group's ParallelConfig, number of groups) for --gpus/--sp/--ring/--cfg-parallel; sp defaults to 1."""
    config = ParallelConfig(sp=1 if sp is None else sp, ring=ring, cfg=cfg)
    if not isinstance(gpus, int) or gpus < 1 or gpus % config.world_size:
        raise ValidationError(
            f"--gpus {gpus} does not split into groups of {config.world_size} "
            f"(--sp {config.sp}{' x 2 for --cfg-parallel' if cfg else ''}); use a multiple of {config.world_size}"
        )
    return config, gpus // config.world_size


def run_render_groups(
    plan: RenderPlan,
    config: ParallelConfig,
    groups: int,
    *,
    resume: bool = True,
    save_frames: bool = False,
    replace_others: bool = False,
) -> RenderSummary:
    """Render the plan's pending jobs on `groups` worlds of config.world_size ranks (see the module docstring)."""
    output_dir = plan.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_output_dir(output_dir):
        # The one-process render's start (check_outputs included), before any worker starts. Jobs have
        # distinct output names (the schema refuses duplicates) and each is handed out once, so no two
        # groups write one path; each output is renamed into place whole, so a killed job leaves only a temp.
        found = start_run(plan, resume=resume, save_frames=save_frames, replace_others=replace_others)
        pending, done = found.pending, found.done
        manifest = output_dir / MANIFEST_NAME
        load_seconds = 0.0
        if pending:
            context = multiprocessing.get_context("spawn")
            jobs = context.Queue()
            for job in pending:
                jobs.put(job.index)
            for _ in range(groups):
                jobs.put(None)  # one stop mark per group
            device_type = resolve_device(plan.device).partition(":")[0]
            loads = run_worlds(
                _group_worker,
                config,
                groups,
                (plan, jobs, save_frames),
                device_type=device_type,
                context=context,
            )
            load_seconds = max(loads)
        latest = latest_by_key(read_manifest(manifest))
        outcomes = []
        for job in plan.jobs:
            if job.label in done:
                outcomes.append(JobOutcome(job, "skipped", 0.0, record=done[job.label]))
                continue
            record = latest.get(plan.request_key(job)) or {}
            ok = record.get("status") == "ok"
            seconds = float(record.get("timings", {}).get("job", 0.0))
            outcomes.append(
                JobOutcome(
                    job, "rendered" if ok else "failed", seconds, error=record.get("error"), record=record
                )
            )
    return RenderSummary(
        output_dir, tuple(outcomes), bool(pending), load_seconds, found.removed_temps, found.notes
    )


def _group_worker(layout: ParallelLayout, plan: RenderPlan, jobs: Any, save_frames: bool) -> float:
    """One rank of one group: load the model once, then run the jobs its rank 0 takes; returns load seconds."""
    start = time.perf_counter()
    pipe = load_pipeline(plan, parallel=layout)  # the one-process render's loader (host-first for offload)
    load_seconds = time.perf_counter() - start
    by_index = {job.index: job for job in plan.jobs}
    manifest = plan.output_dir / MANIFEST_NAME
    # The group's first job pays its start-up: recorded cold, so `mmgen ab` leaves it out of the ratios.
    cold = True
    while True:
        index = jobs.get() if layout.owns_outputs else None
        if not layout.is_single:
            box = [index]
            dist.broadcast_object_list(box, src=0, group=layout.world_group)
            index = box[0]
        if index is None:
            return load_seconds
        job = by_index[index]
        if layout.owns_outputs:
            outcome, _ = _run_job(plan, job, pipe, manifest, save_frames=save_frames, disable=True, cold=cold)
            cold = cold and outcome.status != "rendered"
            continue
        try:
            pipe(progress=False, **job.request.fields_set())
        except Exception:  # noqa: BLE001 - rank 0 meets the same error and records the job as failed
            continue
