"""The values every executor and every face share: what a replica loads, a job, what a job produced,
the one stop signal, and the one refusal that is no verdict on a request.

ModelSpec     what every replica loads (a render file's settings, a server's or `generate`'s flags)
JobSpec       one job: its index, its name and its request
RenderedJob   what one job produced where it ran (raw frames and identity), or its error
JobStopped    raised inside a pipeline, at its next progress report, once its job was stopped
ReplicaUnavailable  no loaded replica answered in time (or none is left)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mmgen.errors import MmgenError, ValidationError
from mmgen.progress import ProgressReporter
from pipelines.common import write_frames
from pipelines.request import GenerationRequest


@dataclass(frozen=True)
class ModelSpec:
    """What every replica loads and how it runs its jobs.

    model: a model directory, or 'default' (the embedded default model, built where it is missing).
    device / dtype: 'auto' or a name (pipelines.loader.resolve_device / resolve_dtype decide).
    fps: the outputs' frame rate (None: each result's own).
    offload / gpu_memory_gb: the pipeline's default memory policy (a server's --offload / --gpu-memory-gb).
    load_on_host: load the weights on the host first (jobs that offload or plan within a GPU budget).
    """

    model: str
    task: str = "t2v"
    device: str = "auto"
    dtype: str = "auto"
    fps: int | None = None
    offload: str | None = None
    gpu_memory_gb: float | None = None
    load_on_host: bool | None = None


@dataclass(frozen=True)
class JobSpec:
    """One fully resolved job: its name and index (in a render file, or a server's queue), and its request."""

    index: int
    name: str | None
    request: GenerationRequest

    @property
    def prompt(self) -> str:
        return self.request.prompt

    @property
    def seed(self) -> int:
        assert self.request.seed is not None  # every job gets one (render's build_plan, the server)
        return self.request.seed

    @property
    def image_sha256(self) -> str | list[str] | None:
        """Of the job's input image (pipelines.image_input), one per image where it has several, or None."""
        return self.request.record().get("image_sha256")

    @property
    def label(self) -> str:
        return self.name if self.name is not None else f"job{self.index:03d}"

    @property
    def stem(self) -> str:
        """The stable base name of this job's output files."""
        return f"{self.label}_s{self.seed}"

    def fields(self) -> dict[str, Any]:
        """The request fields the job sets, but prompt and seed, as JSON values."""
        given = self.request.model_fields_set - {"prompt", "seed"}
        return {name: value for name, value in self.request.record().items() if name in given}


@dataclass(frozen=True)
class RenderedJob:
    """What one job produced where it ran: frames and identity, or the error that stopped it.

    frames: uint8 [T, H, W, 3] (None when the job failed or was stopped). timings: the pipeline's
    stage seconds plus 'render' (the whole call); 'cold' when it was the replica's first call
    (start-up included). replica: where it ran ('local', or a replica's name). lora_loads: LoRA sets
    the pipeline read and applied for this job (0 when it kept the set its previous job left on).
    error: the failure on one line (its type named unless an MmgenError; traceback then says where).
    A client ends it with raise_failure() and save() (a server's job, `mmgen generate`) or its own writer.
    """

    index: int
    label: str
    replica: str
    frames: np.ndarray | None = None
    fps: int | None = None
    args: dict[str, Any] = field(default_factory=dict)
    frames_sha256: str | None = None
    latents_sha256: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)
    memory_gib: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    attention_providers: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    traceback: str | None = None
    lora_loads: int = 0
    refused: bool = False  # the error is the request's (a ValidationError: sizes, inputs the model refuses)
    stopped: bool = False  # stopped between steps (JobStopped): its client asked; nothing to publish
    # In the process it ran in only (portable() drops them): the job's open reporter, so the client's
    # export shows on it, and the pipeline's result, whose own save() writes the frames.
    progress: ProgressReporter | None = field(default=None, compare=False, repr=False)
    result: Any = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def stage_timings(self) -> dict[str, float]:
        """The pipeline's own stage seconds: timings without the whole call ('render') and 'cold'."""
        return {name: value for name, value in self.timings.items() if name not in ("render", "cold")}

    def portable(self) -> RenderedJob:
        """This job without what stays in its process (the reporter, the result): what goes back to a client."""
        return replace(self, progress=None, result=None)

    def raise_failure(self) -> None:
        """Raise what ended this job, by kind (nothing when it produced frames): JobStopped when it was
        stopped, ValidationError when its request was refused, else MmgenError with its one-line error."""
        if self.ok and self.frames is not None:
            return
        if self.stopped:
            raise JobStopped(self.error)
        error = self.error or "no frames came back"
        raise ValidationError(error) if self.refused else MmgenError(error)

    def save(self, path: Path | str, *, fps: int | None = None) -> Path:
        """Write the frames atomically at `path` (.mp4, or .png for one frame, RGBA kept) at `fps` (None:
        the job's): the result's own save where the job ran in this process, else the same writer
        (pipelines.common.write_frames, what GenerationResult.save calls) on the frames that came back."""
        fps = self.fps if fps is None else fps
        if self.result is not None:
            return self.result.save(path, fps=fps)
        assert self.frames is not None, "save() of a job that produced no frames"
        return write_frames(self.frames, path, fps=fps)


class JobStopped(Exception):
    """The one stop signal: raised inside a pipeline at its next progress report (between denoising
    steps, before decode or export) once its job was stopped - cancelled by its client, stopped by the
    driver, or, on a following rank of a group, stopped by rank 0. A stopped job publishes nothing."""


class ReplicaUnavailable(Exception):
    """No loaded replica answered a call in time (or none is left): not a verdict on the request."""
