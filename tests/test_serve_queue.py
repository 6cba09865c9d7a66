"""The pieces of `mmgen serve` without a server: the SQLite job store, the request translation
(size / seconds / form strings / paths) and the worker's progress reporter and cancellation."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")

from mmgen.executors.jobs import JobStopped
from mmgen.serve.protocol import (
    ApiError,
    Limits,
    coerce_form,
    image_submission,
    video_frames,
    video_submission,
)
from mmgen.serve.queue import JobStore, QueueFull, valid_job_id
from mmgen.serve.worker import JobProgress, Worker

LIMITS = Limits(model="tiny", height=48, width=48, num_frames=9, fps=8)


def _param(call, *args) -> str | None:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 400
    return caught.value.param


def test_store_fifo_progress_cancel_and_bound(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    a = store.add("video", {"prompt": "a"}, {"model": "m"})
    b = store.add("video", {"prompt": "b"}, {"model": "m"}, max_unfinished=2)
    assert valid_job_id(a.id, "video") and not valid_job_id(a.id, "image")
    with pytest.raises(QueueFull):
        store.add("video", {"prompt": "c"}, {}, max_unfinished=2)
    assert store.claim().id == a.id  # FIFO
    assert store.set_progress(a.id, 40) is False and store.get(a.id).progress == 40
    assert store.request_cancel(b.id).status == "cancelled"  # queued: cancelled at once
    assert store.request_cancel(a.id).status == "in_progress"  # running: flagged
    assert store.set_progress(a.id, 50) is True
    assert store.complete(a.id, {}, "x.mp4", "0" * 64) is False  # a cancelled job never publishes
    store.finish(a.id, "cancelled")
    assert store.counts() == {"queued": 0, "in_progress": 0, "completed": 0, "failed": 0, "cancelled": 2}
    assert store.claim() is None


def test_store_recover_requeues_interrupted_and_rechecks_outputs(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    running = store.add("video", {"prompt": "a", "seed": 3}, {})
    done = store.add("video", {"prompt": "b"}, {})
    kept = store.add("video", {"prompt": "c"}, {})
    for _ in (running, done, kept):
        store.claim()
    good = tmp_path / "good.mp4"
    good.write_bytes(b"good")
    import hashlib

    store.complete(done.id, {}, str(tmp_path / "missing.mp4"), "0" * 64)
    store.complete(kept.id, {}, str(good), hashlib.sha256(b"good").hexdigest())
    store.close()
    again = JobStore(tmp_path / "jobs.sqlite3")  # a restart
    actions = again.recover()
    assert actions == {"requeued": [running.id], "cancelled": [], "failed": [], "reverified": [done.id]}
    assert again.get(running.id).status == "queued" and again.get(running.id).fields["seed"] == 3
    assert again.get(kept.id).status == "completed"
    assert [again.claim().id, again.claim().id] == [running.id, done.id]


def test_store_fails_what_a_lost_group_rank_interrupted(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    old = store.add("video", {"prompt": "old"}, {})
    refused = store.add("video", {"prompt": "refused"}, {})
    raced = store.add("video", {"prompt": "raced"}, {})
    running = store.add("video", {"prompt": "running"}, {})
    stopping = store.add("video", {"prompt": "stopping"}, {})
    queued = store.add("video", {"prompt": "queued"}, {})
    for job in (old, refused, raced, running, stopping):
        assert store.claim().id == job.id
    store.finish(old.id, "failed", {"code": "server_error", "message": "disk full"})
    since = time.time()
    store.finish(refused.id, "failed", {"code": "invalid_request", "message": "num_frames: no"})
    store.finish(raced.id, "failed", {"code": "server_error", "message": "RuntimeError: connection reset"})
    store.request_cancel(stopping.id)
    cause = "rank 1 was killed (signal 9)"
    assert sorted(store.fail_interrupted(cause, since)) == sorted([raced.id, running.id, stopping.id])
    rows = {job_id: store.get(job_id) for job_id in (old.id, refused.id, raced.id, running.id, stopping.id)}
    assert rows[running.id].status == "failed"
    assert rows[running.id].error == {"code": "server_error", "message": cause}
    assert rows[raced.id].error["message"] == f"{cause}; then RuntimeError: connection reset"
    assert rows[stopping.id].status == "cancelled"
    assert rows[old.id].error["message"] == "disk full"  # failed before the fault: its own cause
    assert rows[refused.id].error["code"] == "invalid_request"
    assert store.get(queued.id).status == "queued"  # runs on the restarted group
    assert store.fail_interrupted(cause, since) == []  # the launcher's second look changes nothing


def test_store_pages(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    ids = [store.add("video", {"prompt": str(i)}, {}).id for i in range(5)]
    store.add("image", {"prompt": "i"}, {})
    jobs, more = store.page("video", after=None, limit=2, order="asc")
    assert [j.id for j in jobs] == ids[:2] and more
    jobs, more = store.page("video", after=ids[1], limit=10, order="asc")
    assert [j.id for j in jobs] == ids[2:] and not more
    jobs, _ = store.page("video", after=ids[3], limit=10, order="desc")
    assert [j.id for j in jobs] == ids[:3][::-1]


def test_size_seconds_and_frames_map_exactly() -> None:
    assert video_frames("1", 8) == 9 and video_frames(0.5, 8) == 5 and video_frames("2", 16) == 33
    assert _param(video_frames, "0.3", 8) == "seconds"
    sub = video_submission({"prompt": "p", "size": "64x32", "seconds": "1", "seed": 5}, LIMITS)
    assert sub.fields == {"prompt": "p", "width": 64, "height": 32, "num_frames": 9, "seed": 5}
    assert sub.options == {"model": "tiny", "fps": 8, "size": "64x32", "seconds": "1"}
    assert "seed" in video_submission({"prompt": "p"}, LIMITS).fields  # drawn, so a re-run is exact
    assert _param(video_submission, {"prompt": "p", "size": "64x32", "width": 48}, LIMITS) == "size"
    image = image_submission({"prompt": "p", "n": 2, "response_format": "url"}, LIMITS)
    assert image.fields["num_frames"] == 1 and image.options["n"] == 2


def test_form_strings_take_the_request_types() -> None:
    form = {
        "prompt": ["p"],
        "num_frames": ["9"],
        "guidance_scale": ["4.5"],
        "compile": ["false"],
        "negative_prompt": [""],
        "fps": ["8"],
        "seconds": ["1"],
        "loras": ["a.safetensors:0.5", '[{"path": "b.safetensors"}]'],
    }
    values = coerce_form(form)
    assert values["num_frames"] == 9 and values["guidance_scale"] == 4.5 and values["compile"] is False
    assert values["negative_prompt"] is None and values["fps"] == 8 and values["seconds"] == "1"
    assert values["loras"] == ["a.safetensors:0.5", {"path": "b.safetensors"}]
    assert _param(coerce_form, {"num_frames": ["nine"]}) == "num_frames"
    assert _param(coerce_form, {"compile": ["maybe"]}) == "compile"
    assert _param(coerce_form, {"seed": ["1", "2"]}) == "seed"


def test_paths_stay_inside_the_given_directories(tmp_path: Path) -> None:
    loras = tmp_path / "loras"
    loras.mkdir()
    (tmp_path / "secret.safetensors").write_bytes(b"x")
    os.symlink(tmp_path / "secret.safetensors", loras / "link.safetensors")
    limits = Limits(model="tiny", height=48, width=48, num_frames=9, fps=8, lora_dir=loras)
    for value in ("../secret.safetensors", str(tmp_path / "secret.safetensors"), "link.safetensors"):
        assert _param(video_submission, {"prompt": "p", "lora": value}, limits) == "lora", value
    assert _param(video_submission, {"prompt": "p", "image": "x.png"}, limits) == "image"  # no --input-dir
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    from PIL import Image

    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(inputs / "in.png")
    limits = Limits(model="tiny", height=48, width=48, num_frames=9, fps=8, input_dir=inputs)
    sub = video_submission({"prompt": "p", "image": "in.png"}, limits)
    assert sub.fields["image"] == str(inputs / "in.png")


def test_progress_reporter_records_and_cancels(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = store.add("video", {"prompt": "p"}, {})
    store.claim()
    seen = []
    progress = JobProgress(store, job.id, live=lambda job_id, value: seen.append((job_id, value)))
    progress.stage("denoise", 4)
    progress.advance()
    progress.advance()
    assert seen == [(job.id, 0), (job.id, 22), (job.id, 45)]
    assert store.get(job.id).progress == 0  # the store is written at most every PROGRESS_WRITE_S
    store.request_cancel(job.id)
    with pytest.raises(JobStopped):
        progress.advance()


def test_worker_runs_jobs_and_cancels_between_steps(tmp_path: Path) -> None:
    """A stand-in pipeline that reports steps: the worker publishes one job and cancels the other."""
    store = JobStore(tmp_path / "jobs.sqlite3")

    class Result:
        frames = np.zeros((1, 16, 16, 3), np.uint8)
        frames_sha256 = latents_sha256 = "0" * 64
        timings, fingerprint, args, memory, attention_providers = {}, {}, {"seed": 1}, {}, {}

        def save(self, path, fps=None):
            path.write_bytes(b"png")
            return path

    def generate(request, *, progress):
        progress.stage("denoise", 3)
        for _ in range(3):
            if request.prompt == "cancel me":
                store.request_cancel(job_ids[1])
            progress.advance()
        return Result()

    pipe = SimpleNamespace(generate=generate)
    job_ids = [
        store.add("image", {"prompt": "fine", "num_frames": 1}, {}).id,
        store.add("image", {"prompt": "cancel me", "num_frames": 1}, {}).id,
    ]
    worker = Worker(store, lambda: pipe, tmp_path / "outputs")
    (tmp_path / "outputs").mkdir()
    for _ in job_ids:
        worker.run_job(pipe, store.claim())
    assert store.get(job_ids[0]).status == "completed"
    cancelled = store.get(job_ids[1])
    assert cancelled.status == "cancelled" and cancelled.progress < 90
    assert not (tmp_path / "outputs" / f"{job_ids[1]}.png").exists()


def test_one_server_per_state_directory_and_none_before_the_model(tmp_path: Path) -> None:
    from mmgen.errors import ValidationError
    from mmgen.serve.service import ServeSettings, Service

    first = Service(ServeSettings(state=tmp_path), "tiny", load=lambda: None)
    with pytest.raises(ApiError) as caught:  # no model yet: size and seconds would map on nothing
        first.submit_video({"prompt": "p"})
    assert caught.value.status == 503
    with pytest.raises(ValidationError, match="another mmgen serve"):
        Service(ServeSettings(state=tmp_path), "tiny", load=lambda: None)
    first.stop()  # never started: releases the lock
    Service(ServeSettings(state=tmp_path), "tiny", load=lambda: None).stop()


def test_a_job_that_keeps_killing_the_server_fails(tmp_path: Path) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = store.add("video", {"prompt": "p"}, {})
    for _ in range(3):  # claimed, then the server dies; recovered on each restart
        assert store.claim().id == job.id
        actions = store.recover()
    assert actions["failed"] == [job.id]
    failed = store.get(job.id)
    assert failed.status == "failed" and "stopped 3 times" in failed.error["message"]


def test_bounds_on_what_one_request_makes() -> None:
    assert _param(video_submission, {"prompt": "p", "seconds": "1e9"}, LIMITS) == "seconds"
    huge = {"prompt": "p", "num_frames": 4001, "size": "1280x720"}
    assert _param(video_submission, huge, LIMITS) == "num_frames"
    assert _param(video_submission, {"prompt": "p", "lora": [{"path": 3}]}, LIMITS) == "lora"
    conflict = {"prompt": "p", "preset": "distill-4step", "num_inference_steps": 3}
    assert _param(video_submission, conflict, LIMITS) == "num_inference_steps"


def test_worker_is_ready_only_once_the_model_loaded(tmp_path: Path) -> None:
    import threading

    release = threading.Event()
    loaded = []
    store = JobStore(tmp_path / "jobs.sqlite3")
    worker = Worker(store, lambda: release.wait(10) and "pipe", tmp_path / "outputs", on_ready=loaded.append)
    worker.start()
    try:
        assert worker.alive and not worker.ready  # /health answers 503 "loading"
        release.set()
        deadline = time.monotonic() + 10
        while not worker.ready:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert loaded == ["pipe"]
    finally:
        worker.stop(timeout=5)
    assert not worker.alive

    def broken() -> None:
        raise OSError("no weights here")

    failed = Worker(store, broken, tmp_path / "outputs")
    failed.start()
    failed.stop(timeout=5)
    assert not failed.ready and "no weights here" in failed.load_error


@pytest.mark.parametrize(
    "when", ["after the last step", "while the file is written", "just before publishing"]
)
def test_a_cancel_after_the_last_denoising_step_publishes_nothing(tmp_path: Path, when: str) -> None:
    """However late the cancel comes (the steps all done, the output being written, the row about to
    be published), the job ends cancelled with no output file and no output on its row."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()

    class Store(JobStore):
        def complete(self, job_id: str, *args, **kwargs) -> bool:
            if when == "just before publishing":  # after the worker's last look at the row
                self.request_cancel(job_id)
            return super().complete(job_id, *args, **kwargs)

    store = Store(tmp_path / "jobs.sqlite3")
    job_id = store.add("image", {"prompt": "p", "num_frames": 1}, {}).id

    class Result:
        frames = np.zeros((1, 16, 16, 3), np.uint8)
        frames_sha256 = latents_sha256 = "0" * 64
        timings, fingerprint, args, memory, attention_providers = {}, {}, {"seed": 1}, {}, {}

        def save(self, path, fps=None):
            path.write_bytes(b"png")
            if when == "while the file is written":
                store.request_cancel(job_id)
            return path

    def generate(request, *, progress):
        progress.stage("denoise", 2)
        progress.advance()
        progress.advance()  # the last step's report: the job is not cancelled yet
        if when == "after the last step":
            store.request_cancel(job_id)
        return Result()

    pipe = SimpleNamespace(generate=generate)
    worker = Worker(store, lambda: pipe, outputs)
    worker.run_job(pipe, store.claim())
    job = store.get(job_id)
    assert (job.status, job.output, job.output_sha256) == ("cancelled", None, None)
    assert list(outputs.iterdir()) == []  # nothing published, nothing left behind
