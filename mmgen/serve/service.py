"""What the routes call: the store, the worker and the metrics of one server, and the job lifecycle.

Everything here is quick (a validation, a row written or read, a file removed); GPU work happens
only in the worker. Paths a client can reach are the server's own: `<state>/outputs/<id>.mp4|png`
and a job's uploaded files `<state>/uploads/<id>/<form field>-<n>.<ext>`, named by random ids that
every route validates first. The stored request names the uploaded files by those paths, so a
restart (even after kill -9) runs the job on the same inputs; deleting the job removes them.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmgen.errors import ValidationError
from mmgen.executors.jobs import ModelSpec
from mmgen.outputs.writers import atomic_write_bytes
from mmgen.serve.metrics import ServeMetrics
from mmgen.serve.protocol import (
    IMAGE_OPTIONS,
    UPLOADS,
    VIDEO_OPTIONS,
    ApiError,
    JobError,
    Limits,
    Submission,
    UploadField,
    VideoJob,
    bad_request,
    check_alone,
    edit_uploads,
    image_submission,
    input_fields,
    upload_suffix,
    video_submission,
)
from mmgen.serve.queue import UNFINISHED, Job, JobStore, QueueFull, new_job_id, valid_job_id
from mmgen.serve.replicas import RayWorker
from mmgen.serve.worker import Worker
from pipelines.capabilities import Capabilities
from pipelines.checks import MAX_PIXELS, MAX_SEED

FINISHED = ("completed", "failed", "cancelled")


@dataclass(frozen=True)
class ServeSettings:
    """Server-wide settings: where state lives, the key, and the bounds on what a client may send."""

    state: Path
    api_key: str | None = None
    max_queue: int = 256
    max_body_bytes: int = 32 << 20
    # A JSON body carries no files: what it holds (a prompt and settings) is far under this.
    max_json_bytes: int = 1 << 20
    max_upload_bytes: int = 16 << 20
    max_pixels: int = MAX_PIXELS  # frames x height x width of one job (at most the request bound)
    image_wait_s: float = 3600.0
    retry_after_s: int = 5


class Service:
    """One server's job store, worker and metrics. `load()` builds the pipeline, in the worker thread;
    `spec`: what it loads (mmgen.executors.jobs.ModelSpec; None: a pipeline on the CPU); `group`: rank
    0's GroupLink under --gpus N (mmgen.executors.group_link), None alone. `executor`: under --ray,
    builds the Ray replicas that run the jobs instead (mmgen.serve.replicas; `load` unused).
    `restarting`: why the launcher started this server's process group again (mmgen.serve.cli: a rank
    was killed or hung); /health and the 503s say so until the model has loaded."""

    def __init__(
        self,
        settings: ServeSettings,
        model: str,
        load: Callable[[], Any],
        *,
        lora_dir: Path | None = None,
        input_dir: Path | None = None,
        group: Any = None,
        executor: Callable[[], Any] | None = None,
        spec: ModelSpec | None = None,
        restarting: str | None = None,
    ) -> None:
        self.settings = settings
        self.restarting = restarting
        self.model = model
        self._dirs = {"lora_dir": lora_dir, "input_dir": input_dir}
        # The loaded pipeline's defaults (size, frames, fps) decide what `size`/`seconds` map to, so
        # requests are taken once it has loaded (503 before).
        self.limits: Limits | None = None
        # What the loaded model does (pipelines.capabilities), as its family reports it; None while loading.
        self.capabilities: Capabilities | None = None
        state = Path(settings.state)
        state.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_state(state)
        self.uploads = state / "uploads"
        self.uploads.mkdir(exist_ok=True)
        self.store = JobStore(state / "jobs.sqlite3")
        self.recovered = self.store.recover()
        self.metrics = ServeMetrics(self.store)
        self.worker: Worker
        if executor is None:
            self.worker = Worker(
                self.store,
                load,
                state / "outputs",
                self.metrics,
                on_ready=self._loaded,
                group=group,
                spec=spec,
            )
        else:
            self.worker = RayWorker(
                self.store, executor, state / "outputs", self.metrics, on_ready=self._loaded
            )
        self.started_at = int(time.time())

    def start(self) -> None:
        self.worker.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self.worker.stop(timeout)
        self._lock.close()

    @property
    def makes_video(self) -> bool:
        """False for a model that outputs images (/v1/videos is a 400); True while loading."""
        return self.capabilities is None or self.capabilities.outputs == "video"

    @property
    def edits_images(self) -> bool:
        """True for an edit model (/v1/images/edits)."""
        return self.capabilities is not None and self.capabilities.has("edit")

    @property
    def edit_uploads(self) -> dict[str, UploadField]:
        """POST /v1/images/edits's files: one image, or several for a model that reads several."""
        return edit_uploads(self.capabilities)

    @property
    def upload_fields(self) -> tuple[str, ...]:
        """The form files the loaded model takes (what the page at / offers): VACE's control inputs, an
        image-to-video model's input_reference (/v1/videos), an edit model's image (/v1/images/edits)."""
        return () if self.capabilities is None else self.capabilities.uploads

    def _loaded(self, pipe: Any) -> None:
        defaults = pipe.defaults
        self.capabilities = pipe.capabilities
        self.limits = Limits(
            model=self.model,
            height=defaults.height,
            width=defaults.width,
            num_frames=defaults.num_frames,
            fps=defaults.fps,
            max_pixels=self.settings.max_pixels,
            model_check=lambda request: _model_check(pipe, request),
            inputs=input_fields(self.upload_fields),
            **self._dirs,
        )

    def unavailable(self) -> ApiError | None:
        """The 503 every route but /health answers until the model has loaded (or once the worker is
        down); None when the server takes requests."""
        if self.worker.ready and self.limits is not None:
            return None
        if self.worker.alive and not self.worker.ready:
            why = "the model is still loading"
            if self.restarting is not None:
                why = f"the process group is restarting ({self.restarting}); the model is loading"
            return ApiError(503, f"{why}; retry shortly", kind="service_unavailable")
        state = self.worker.load_error or "stopped"
        return ApiError(503, f"the worker is down ({state})", kind="service_unavailable")

    def _limits(self, body: dict[str, Any], options: tuple[str, ...]) -> Limits:
        """The loaded model's Limits; before it has loaded, a 400 for what `body` is refused for
        without the model (protocol.check_alone), else a 503."""
        refusal = self.unavailable()
        if refusal is not None:
            check_alone(body, options, self.model)
            raise refusal
        assert self.limits is not None
        return self.limits

    # -- creating jobs --

    def submit_video(self, body: dict[str, Any], uploads: dict[str, list[bytes]] | None = None) -> Job:
        """Check and queue a video job (`uploads`: the form's files per field, protocol.UPLOADS); ApiError if refused."""
        limits = self._limits(body, VIDEO_OPTIONS)
        if not self.makes_video:
            raise bad_request(
                f"model {limits.model!r} makes images only, not videos: use POST /v1/images/generations",
                "model",
            )
        job_id = new_job_id("video")
        folder = self.uploads / job_id
        try:
            stored = self._store_uploads(folder, uploads or {}, UPLOADS)
            submission = video_submission(body, limits, stored)
            return self._add("video", submission, job_id, folder if stored else None)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    def submit_images(self, body: dict[str, Any]) -> list[Job]:
        """Check and queue `n` image jobs (seeds seed, seed + 1, ... when a seed is given)."""
        limits = self._limits(body, IMAGE_OPTIONS)
        return self._add_images(image_submission(body, limits), new_job_id("image"), None)

    def submit_edits(self, body: dict[str, Any], uploads: dict[str, list[bytes]]) -> list[Job]:
        """Check and queue `n` edit jobs of the uploaded `image` (`uploads`: the form's files per field,
        edit_uploads), as submit_images. The file is stored in the first job's upload folder,
        which every job's row and request name."""
        limits = self._limits(body, IMAGE_OPTIONS)
        if not self.edits_images:
            route = "/v1/images/generations" if not self.makes_video else "/v1/videos"
            raise bad_request(
                f"model {limits.model!r} does not edit images (POST /v1/images/edits needs an edit model: "
                f"{_edit_families()}): use POST {route}",
                "model",
            )
        job_id = new_job_id("image")
        folder = self.uploads / job_id
        try:
            stored = self._store_uploads(folder, uploads, self.edit_uploads)
            submission = image_submission(body, limits, stored, self.edit_uploads)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        try:
            return self._add_images(submission, job_id, folder)
        except BaseException:
            if self.store.get(job_id) is None:  # no job names the file (a full queue): remove it
                shutil.rmtree(folder, ignore_errors=True)
            raise

    def _add_images(self, submission: Submission, first_id: str, upload: Path | None) -> list[Job]:
        """Queue submission.options["n"] image jobs (the first is `first_id`), seeds seed, seed + 1, ..."""
        jobs = []
        for index in range(submission.options["n"]):
            fields = dict(submission.fields)
            if index:
                fields["seed"] = (fields["seed"] + index) % (MAX_SEED + 1)  # in the range, distinct
            job_id = first_id if index == 0 else new_job_id("image")
            jobs.append(self._add("image", Submission(fields, submission.options), job_id, upload))
        return jobs

    def _add(self, kind: str, submission: Submission, job_id: str, upload: Path | None) -> Job:
        try:
            job = self.store.add(
                kind,
                submission.fields,
                submission.options,
                max_unfinished=self.settings.max_queue,
                job_id=job_id,
                upload=None if upload is None else str(upload),
            )
        except QueueFull as err:
            raise ApiError(429, f"queue full: {err}; retry later", kind="rate_limit_error") from None
        self.worker.wake()
        return job

    def _store_uploads(
        self, folder: Path, uploads: dict[str, list[bytes]], rules: Mapping[str, UploadField]
    ) -> dict[str, list[Path]]:
        """Each uploaded file, its kind checked by its first bytes against `rules` (the route's upload
        fields), written into `folder` (the job's)."""
        limit = self.settings.max_upload_bytes
        kinds = {
            param: [upload_suffix(param, data, rules) for data in files] for param, files in uploads.items()
        }
        stored: dict[str, list[Path]] = {}
        for param, files in uploads.items():
            for index, (data, suffix) in enumerate(zip(files, kinds[param], strict=True)):
                if len(data) > limit:
                    raise ApiError(413, f"{param}: {len(data)} bytes; at most {limit}", param=param)
                folder.mkdir(exist_ok=True)
                path = atomic_write_bytes(folder / f"{param}-{index}{suffix}", data)
                stored.setdefault(param, []).append(path)
        return stored

    # -- reading and ending jobs --

    def job(self, job_id: str, kind: str) -> Job:
        """The job `job_id` of `kind`; 404 for a malformed or unknown id."""
        job = self.store.get(job_id) if valid_job_id(job_id, kind) else None
        if job is None or job.kind != kind:
            raise ApiError(404, f"no {kind} job {job_id!r}", param="id", kind="not_found_error")
        return job

    def output(self, job_id: str, kind: str) -> Path:
        """The finished output of a job; 404 unknown, 409 not completed."""
        job = self.job(job_id, kind)
        if job.status != "completed" or job.output is None:
            raise ApiError(
                409, f"{kind} job {job_id} is {job.status}; its content exists once completed", param="id"
            )
        return Path(job.output)

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a job: a queued one now (counted as ended, cancelled, in the metrics), a running one
        between steps (flagged; the worker ends it and counts it)."""
        job, ended = self.store.cancel(job_id)
        if ended:
            self.metrics.finished.labels(outcome="cancelled").inc()
        self.worker.wake()
        return job

    def delete(self, job_id: str) -> bool:
        """DELETE /v1/videos/{id}: a finished job (completed, failed, cancelled) is deleted, its row,
        output and uploads removed: True. An unfinished one is cancelled, not deleted: False (a queued
        job ends cancelled now, a running one between steps; its row stays until a DELETE after it ended)."""
        job = self.job(job_id, "video")
        if job.status in UNFINISHED:
            self.cancel(job_id)
            return False
        self.store.delete(job_id)
        if job.output:
            Path(job.output).unlink(missing_ok=True)
        if job.upload:  # the job's folder of uploads (one file under an older server)
            upload = Path(job.upload)
            if upload.is_dir():
                shutil.rmtree(upload, ignore_errors=True)
            else:
                upload.unlink(missing_ok=True)
        return True

    def video_view(self, job: Job, *, record: bool = True) -> VideoJob:
        """A job as GET /v1/videos/{id} shows it; record False: without the recorded request (a list
        shows each prompt once, so a page polling it reads at most its limit of bounded prompts)."""
        result = job.result or {}
        return VideoJob(
            id=job.id,
            status=job.status,
            progress=100 if job.status == "completed" else self.worker.progress_of(job),
            created_at=int(job.created_at),
            completed_at=None if job.completed_at is None else int(job.completed_at),
            model=job.options["model"],
            size=job.options["size"],
            seconds=job.options["seconds"],
            prompt=job.fields["prompt"],
            error=None if job.error is None else JobError(**job.error),
            frames_sha256=result.get("frames_sha256"),
            latents_sha256=result.get("latents_sha256"),
            output_sha256=job.output_sha256,
            timings=result.get("timings"),
            fingerprint=result.get("fingerprint"),
            request=_client_view(result.get("request"), self.uploads / job.id) if record else None,
        )


def _client_view(request: dict[str, Any] | None, folder: Path) -> dict[str, Any] | None:
    """The recorded request as a client sees it: the server's copies of the job's uploads (under its
    state directory, which is the server's business) shown as `upload:<file>`."""
    if request is None:
        return None
    prefix = str(folder) + os.sep

    def shown(value: Any) -> Any:
        if isinstance(value, str) and value.startswith(prefix):
            return "upload:" + value[len(prefix) :]
        return [shown(item) for item in value] if isinstance(value, list) else value

    return {name: shown(value) for name, value in request.items()}


def _model_check(pipe: Any, request: Any) -> Any:
    """What `pipe` refuses in `request`, raised before the job is queued: the pipeline's own
    model-dependent checks (`check_request`, any family), which read only the model's config and
    the request (and its inputs), so they run on the HTTP side while the worker runs another job.
    Returns the request with the model's defaults filled in (the size and frames the job will make)."""
    return pipe.check_request(request)


def _lock_state(state: Path) -> Any:
    """An exclusive lock on `state` for this process's life (the OS drops it when the process dies,
    even by kill -9): two servers on one queue would run its jobs twice."""
    handle = open(state / "serve.lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ValidationError(f"--state {state}: another mmgen serve is using it") from None
    return handle


def _edit_families() -> str:
    """The registered families whose models edit images, by title (for the refusal above)."""
    from mmgen.families import families  # the registry reads entry points: only when refusing

    return ", ".join(f.title for f in families() if "edit" in f.capabilities.tasks) or "none registered"
