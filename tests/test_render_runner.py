"""Batch renders on the embedded default model: outputs, manifest, resume, failures, crash leftovers."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import imageio_ffmpeg
import pytest

from mmgen.errors import MmgenError
from mmgen.outputs.writers import TEMP_MARKER
from mmgen.render.manifest import MANIFEST_NAME, read_manifest
from mmgen.render.runner import LOCK_NAME, exclusive_output_dir, load_pipeline, run_render
from mmgen.render.schema import load_render_file

# Tiny jobs: 16x16 / 32x32, 1-5 frames, 1-2 steps; the point is the bookkeeping, not the pictures.
THREE_JOBS = """\
    model: default
    device: cpu
    dtype: float32
    defaults: {height: 16, width: 16, num_frames: 5, num_inference_steps: 1, guidance_scale: 1.0, max_sequence_length: 16}
    seeds: {increment_from: 10}
    jobs:
      - {name: cat, prompt: a small cat}
      - {name: dog, prompt: a dog in the snow, width: 32}
      - {prompt: a red boat on a lake, num_frames: 1}
"""


@pytest.fixture(scope="module")
def model_cache(mmgen_cache_dir):
    """Point `model: default` at the session's embedded default model (conftest builds it once)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    yield mmgen_cache_dir
    patch.undo()


@pytest.fixture(scope="module")
def counting_loader(model_cache):
    """A pipeline factory that loads the real model once and counts how often a run asked for one."""
    loaded = {}
    calls = []

    def factory(plan):
        calls.append(plan.source)
        if "pipe" not in loaded:
            loaded["pipe"] = load_pipeline(plan)
        return loaded["pipe"]

    factory.calls = calls
    return factory


def _plan(tmp_path, text=THREE_JOBS, name="batch.yaml", out="out"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return load_render_file(path, output_dir=tmp_path / out)


def _frame_count(path):
    return imageio_ffmpeg.count_frames_and_secs(str(path))[0]


def test_three_jobs_then_rerun_does_no_work(tmp_path, counting_loader):
    plan = _plan(tmp_path)
    before = len(counting_loader.calls)
    summary = run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert summary.exit_code == 0 and summary.model_loaded
    assert [o.status for o in summary.outcomes] == ["rendered"] * 3
    assert len(counting_loader.calls) == before + 1  # one model load for all jobs
    out = plan.output_dir
    names = ["cat_s10.mp4", "dog_s11.mp4", "job002_s12.mp4"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, MANIFEST_NAME, LOCK_NAME])
    assert [_frame_count(out / n) for n in names] == [5, 5, 1]
    records = read_manifest(out / MANIFEST_NAME)
    assert len(records) == 3 and len((out / MANIFEST_NAME).read_text().splitlines()) == 3
    for record, name in zip(records, names, strict=True):
        assert record["status"] == "ok"
        assert record["outputs"][0]["path"] == name
        assert len(record["frames_sha256"]) == 64 and len(record["latents_sha256"]) == 64
        assert record["fingerprint"]["attention_providers"] == record["attention_providers"]
        assert record["args"]["seed"] == record["request"]["seed"]
        assert {"text_encode", "denoise", "decode", "export", "job"} <= set(record["timings"])
    assert records[1]["args"]["width"] == 32 and records[1]["frames_shape"] == [5, 16, 32, 3]
    mtimes = {n: (out / n).stat().st_mtime_ns for n in names}

    again = run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert not again.model_loaded and again.exit_code == 0
    assert [o.status for o in again.outcomes] == ["skipped"] * 3
    assert len(counting_loader.calls) == before + 1  # no model load at all
    assert len(read_manifest(out / MANIFEST_NAME)) == 3
    assert {n: (out / n).stat().st_mtime_ns for n in names} == mtimes
    assert "0 rendered, 3 already done, 0 failed; no model load" in again.format()

    # Another file whose job 'cat' (same name and seed) asks for something else would overwrite
    # cat_s10.mp4: refused before any model load, naming the file and the request that made it.
    edited = _plan(tmp_path, THREE_JOBS.replace("a small cat", "a small black cat"), name="batch2.yaml")
    with pytest.raises(
        MmgenError, match=r"refusing to overwrite .*cat_s10\.mp4 \(job cat\) was rendered by "
    ):
        run_render(edited, pipeline_factory=counting_loader, show_progress=False)
    assert len(counting_loader.calls) == before + 1
    assert {n: (out / n).stat().st_mtime_ns for n in names} == mtimes

    # --no-resume renders everything again, bit-identically, and appends the new records.
    fresh = run_render(plan, resume=False, pipeline_factory=counting_loader, show_progress=False)
    assert [o.status for o in fresh.outcomes] == ["rendered"] * 3
    records = read_manifest(out / MANIFEST_NAME)
    assert len(records) == 6
    assert [r["frames_sha256"] for r in records[:3]] == [r["frames_sha256"] for r in records[3:]]


def test_failed_job_is_recorded_and_batch_goes_on(tmp_path, counting_loader, monkeypatch):
    plan = _plan(tmp_path)
    real = counting_loader(plan)

    def flaky(request, *, progress):
        if request.prompt == "a dog in the snow":
            raise RuntimeError("simulated out of memory")
        return real.generate(request, progress=progress)

    summary = run_render(
        plan, pipeline_factory=lambda p: SimpleNamespace(generate=flaky), show_progress=False
    )
    assert summary.exit_code == 1
    assert [o.status for o in summary.outcomes] == ["rendered", "failed", "rendered"]
    text = summary.format()
    assert "failed: dog (RuntimeError: simulated out of memory)" in text
    records = read_manifest(plan.output_dir / MANIFEST_NAME)
    assert [r["status"] for r in records] == ["ok", "failed", "ok"]
    assert (
        records[1]["error"] == "RuntimeError: simulated out of memory" and records[1]["job"]["label"] == "dog"
    )
    assert not (plan.output_dir / "dog_s11.mp4").exists()

    # The rerun renders only the failed job.
    retry = run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert [o.status for o in retry.outcomes] == ["skipped", "rendered", "skipped"]
    assert retry.exit_code == 0


def test_leftovers_of_a_killed_run_are_repaired(tmp_path, counting_loader):
    """Every state a kill can leave: a stale temp file, an output without a record, a partial line."""
    plan = _plan(tmp_path)
    run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    out = plan.output_dir
    manifest = out / MANIFEST_NAME
    lines = manifest.read_text().splitlines(keepends=True)
    original = [json.loads(line) for line in lines]
    # job 0 intact; job 1: output on disk but its record lost (killed between rename and append);
    # job 2: record half-written (killed mid-append); plus a temp file of an interrupted encode.
    manifest.write_text(lines[0] + lines[2][: len(lines[2]) // 2])
    (out / "job002_s12.mp4").unlink()
    stale = out / f".dog_s11{TEMP_MARKER}999-deadbeef.mp4"
    stale.write_bytes(b"\x00" * 100)

    summary = run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert [o.status for o in summary.outcomes] == ["skipped", "rendered", "rendered"]
    assert summary.removed_temps == (stale,)
    assert not [p for p in out.iterdir() if TEMP_MARKER in p.name]
    records = read_manifest(manifest)
    assert [r["job"]["label"] for r in records] == ["cat", "dog", "job002"]
    assert all(
        line.endswith("\n") and json.loads(line) for line in manifest.read_text().splitlines(keepends=True)
    )
    assert [r["frames_sha256"] for r in records] == [r["frames_sha256"] for r in original]

    # A damaged output (wrong bytes) is rendered again even though its record exists.
    (out / "cat_s10.mp4").write_bytes(b"truncated")
    summary = run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert [o.status for o in summary.outcomes] == ["rendered", "skipped", "skipped"]
    assert _frame_count(out / "cat_s10.mp4") == 5


def test_t2i_prompts_file_writes_pngs(tmp_path, model_cache):
    (tmp_path / "prompts.jsonl").write_text(
        '{"name": "one", "prompt": "a cat"}\n{"prompt": "a dog", "seed": 4}\n'
    )
    plan = _plan(
        tmp_path,
        """\
        task: t2i
        device: cpu
        prompts_file: prompts.jsonl
        defaults: {height: 16, width: 32, num_inference_steps: 1, guidance_scale: 1.0, max_sequence_length: 16}
        """,
        name="t2i.yaml",
    )
    summary = run_render(plan, show_progress=False)  # the real loader: WanT2IPipeline
    assert summary.exit_code == 0
    from PIL import Image

    assert Image.open(plan.output_dir / "one_s0.png").size == (32, 16)
    assert Image.open(plan.output_dir / "job001_s4.png").size == (32, 16)
    assert [r["frames_shape"] for r in read_manifest(plan.output_dir / MANIFEST_NAME)] == [[1, 16, 32, 3]] * 2


def test_one_render_per_output_directory(tmp_path, counting_loader):
    plan = _plan(tmp_path)
    plan.output_dir.mkdir()
    with exclusive_output_dir(plan.output_dir):  # as another live render would hold it
        with pytest.raises(MmgenError, match="another mmgen render is writing to this directory"):
            run_render(plan, pipeline_factory=counting_loader, show_progress=False)
    assert not (plan.output_dir / MANIFEST_NAME).exists()
