"""The executors' clients end a job alike wherever it ran: serve's worker publishes a job it ran here
and one a replica sent back (only strings and flags) with the same status and error; an in-process
executor leading a group hands each job to the group and broadcasts each report's decision, while
the client's export stays on the job's own reporter; a RenderedJob writes the same bytes (RGBA kept)
from the pipeline's result and from the frames that came back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")

from mmgen.errors import LoadError, ValidationError
from mmgen.executors.in_process import InProcessExecutor, render_job
from mmgen.executors.jobs import JobSpec, JobStopped, ModelSpec
from mmgen.progress import NullProgress
from mmgen.serve.queue import JobStore
from mmgen.serve.worker import Worker
from pipelines.common import GenerationResult
from pipelines.request import GenerationRequest

SPEC = ModelSpec(model="stand-in", device="cpu")


def _result(frames: np.ndarray) -> GenerationResult:
    return GenerationResult(
        frames=frames,
        frames_sha256="f" * 64,
        latents=torch.zeros(1),
        latents_sha256="l" * 64,
        timings={"denoise": 0.5},
        fingerprint={},
        attention_providers={"self": "sdpa"},
        args={"fps": 8},
    )


@pytest.mark.parametrize(
    ("error", "status", "expected"),
    [
        (KeyError("x"), "failed", {"code": "server_error", "message": "KeyError: 'x'"}),
        (LoadError("lora.safetensors: gone"), "failed", {"code": "server_error", "message": "lora.safetensors: gone"}),
        (ValidationError("height = 100: not a multiple of 16"), "failed",
         {"code": "invalid_request", "message": "height = 100: not a multiple of 16"}),
        (JobStopped("cancelled"), "cancelled", None),
    ],
)  # fmt: skip
def test_a_job_ends_alike_here_and_on_a_replica(tmp_path: Path, error, status, expected) -> None:
    store = JobStore(tmp_path / "jobs.sqlite3")
    outputs = tmp_path / "outputs"
    outputs.mkdir()

    def generate(request, *, progress):
        progress.stage("denoise", 1)
        raise error

    pipe = SimpleNamespace(generate=generate)
    worker = Worker(store, lambda: pipe, outputs)
    here = store.add("image", {"prompt": "p", "num_frames": 1}, {}).id
    worker.run_job(pipe, store.claim())

    there = store.add("image", {"prompt": "p", "num_frames": 1}, {}).id
    job = store.claim()
    spec = JobSpec(job.seq, job.id, GenerationRequest.from_call(**job.fields))
    sent = render_job(SPEC, spec, pipe, progress=NullProgress(), cold=False, replica="r").portable()
    assert sent.result is None and sent.progress is None  # what crosses processes: strings and flags
    worker.end_job(job, lambda output, started: worker.write(job, sent, output, started))

    for job_id in (here, there):
        ended = store.get(job_id)
        assert (ended.status, ended.error) == (status, expected), job_id
    assert list(outputs.iterdir()) == []


class Link:
    """A stand-in GroupLink: what rank 0 would send the other ranks."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    def job(self, request: GenerationRequest) -> None:
        self.sent.append(("job", request.prompt))

    def flag(self, stop: bool) -> None:
        self.sent.append(("flag", stop))


class Reporter:
    """A job's own reporter: stops the job named 'stop' at its second step (as a cancel would)."""

    def __init__(self, job: JobSpec) -> None:
        self.job, self.reports, self.closed = job, [], False

    def stage(self, name: str, total: int) -> None:
        self.reports.append(name)

    def advance(self, units: int = 1) -> None:
        self.reports.append("step")
        if self.job.prompt == "stop" and self.reports.count("step") == 2:
            raise JobStopped(self.job.label)

    def close(self) -> None:
        self.closed = True


def test_rank_0_leads_each_job_and_keeps_the_export_on_the_jobs_reporter() -> None:
    frames = np.zeros((1, 16, 16, 3), np.uint8)

    def generate(request, *, progress):
        progress.stage("denoise", 2)
        progress.advance()
        progress.advance()
        return _result(frames)

    link = Link()
    jobs = [
        JobSpec(0, "go", GenerationRequest(prompt="go")),
        JobSpec(1, "stop", GenerationRequest(prompt="stop")),
    ]
    executor = InProcessExecutor(
        SPEC, lambda: SimpleNamespace(generate=generate), progress=Reporter, link=link
    )
    with executor:
        done = []
        for rendered in executor.run(jobs):
            rendered.progress.stage("export", 1)  # the client's export: the group is not asked
            done.append(rendered)
    assert link.sent == [
        ("job", "go"), ("flag", False), ("flag", False), ("flag", False),
        ("job", "stop"), ("flag", False), ("flag", False), ("flag", True),  # every rank leaves at step 2
    ]  # fmt: skip
    assert done[0].ok and done[0].timings["cold"] and done[0].stage_timings == {"denoise": 0.5}
    assert done[1].stopped and not done[1].ok and done[1].frames is None
    assert [r.progress.reports for r in done] == [
        ["denoise", "step", "step", "export"],
        ["denoise", "step", "step", "export"],
    ]
    assert all(r.progress.closed for r in done)
    with pytest.raises(JobStopped):
        done[1].raise_failure()
    done[0].raise_failure()  # produced frames: nothing to raise


def test_rendered_job_writes_the_same_bytes_here_and_from_a_replica(tmp_path: Path) -> None:
    """An RGBA frame (Qwen-Image-2.1's PNGs keep their alpha): the result's own save and the writer on
    the frames that came back give one file, byte for byte."""
    rgba = np.random.default_rng(0).integers(0, 256, (1, 16, 24, 4), dtype=np.uint8)
    spec = JobSpec(0, "image", GenerationRequest(prompt="p"))
    pipe = SimpleNamespace(generate=lambda request, *, progress: _result(rgba))
    here = render_job(SPEC, spec, pipe, progress=NullProgress(), cold=False, replica="local")
    assert here.result is not None and here.fps == 8
    a = here.save(tmp_path / "here.png")
    b = here.portable().save(tmp_path / "replica.png")
    assert a.read_bytes() == b.read_bytes()
    with Image.open(b) as image:
        assert image.mode == "RGBA" and np.array_equal(np.asarray(image), rgba[0])
