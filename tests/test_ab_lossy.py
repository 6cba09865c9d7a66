"""`mmgen ab` as the quality ledger of lossy settings (issue 20): SSIM, the prompt-following seam,
declared lossy variables and timings over warmed jobs."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from mmgen.render.ab import format_report, run_ab
from mmgen.render.metrics import frame_diff, ssim_uint8
from mmgen.render.runner import load_pipeline

BASE = """\
    model: {model}
    device: cpu
    dtype: float32
    defaults:
      height: 32
      width: 48
      num_frames: 5
      num_inference_steps: 5
      guidance_scale: 5.0
      max_sequence_length: 16
    jobs:
      - {{name: ball, prompt: a red ball moves left, seed: 1}}
"""


@pytest.fixture(autouse=True)
def model_cache(mmgen_cache_dir, monkeypatch):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))


@pytest.fixture(scope="module")
def counted():
    """A factory loading the model once; `calls` counts the pipeline calls (warm-up and timed jobs)."""
    state = {"pipe": None, "calls": 0}

    class Counting:
        def __init__(self, pipe):
            self.pipe = pipe

        def generate(self, *args, **kwargs):
            state["calls"] += 1
            return self.pipe.generate(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.pipe, name)

    def factory(plan):
        if state["pipe"] is None:
            state["pipe"] = Counting(load_pipeline(plan))
        return state["pipe"]

    factory.state = state
    return factory


def _config(tmp_path, model="default"):
    path = tmp_path / "base.yaml"
    path.write_text(textwrap.dedent(BASE.format(model=model)))
    return path


def test_ssim_is_one_for_equal_frames_and_falls_with_noise():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (2, 24, 32, 3), dtype=np.uint8)
    assert ssim_uint8(a, a) == pytest.approx(1.0)
    small = np.clip(a.astype(int) + rng.integers(-8, 9, a.shape), 0, 255).astype(np.uint8)
    large = np.clip(a.astype(int) + rng.integers(-60, 61, a.shape), 0, 255).astype(np.uint8)
    assert 1.0 > ssim_uint8(a, small) > ssim_uint8(a, large) > 0.0
    assert frame_diff(a, small).ssim == pytest.approx(ssim_uint8(a, small))
    assert ssim_uint8(a[:, :2, :2], small[:, :2, :2]) is None  # no window fits 2x2 frames


def test_ab_reports_psnr_ssim_prompt_following_and_warmed_times(tmp_path, counted):
    scored = []

    def fake_scorer(frames, prompt):
        scored.append((frames.shape, prompt))
        return {"score": 0.5 if len(scored) == 1 else 0.25}

    counted.state["calls"] = 0
    result = run_ab(
        _config(tmp_path),
        sets=["step_cache=10", "cfg_truncation=0.5"],
        out_dir=tmp_path / "ab",
        show_progress=False,
        pipeline_factory=counted,
        prompt_scorer=fake_scorer,
    )
    report = result.report
    assert report["declared"] == ["cfg_truncation", "step_cache"] and not report["refused"]
    (row,) = report["jobs"]
    assert not row["sha_equal"]
    assert 0 < row["psnr"] < 80 and 0 < row["ssim"] < 1  # a finite, lossy figure (step_cache=10 is harsh)
    assert row["candidate_lossy"] == {
        "step_cache": 10.0,
        "cfg_truncation": 0.5,
        "step_cache_reused": [1, 2, 3],
    }
    # The seam: both sides' frames scored against the job's prompt.
    assert scored == [((5, 32, 48, 3), "a red ball moves left")] * 2
    assert (row["base_prompt_following"], row["candidate_prompt_following"]) == (0.5, 0.25)
    # Warm-up: one untimed render per side before its timed job (2 warm-ups + 2 jobs).
    assert counted.state["calls"] == 4
    assert set(report["startup"]) == {"base", "candidate"}
    assert all(info["job"] == "ball" and info["warmup_s"] > 0 for info in report["startup"].values())
    assert row["denoise_ratio"] == pytest.approx(row["candidate_denoise_s"] / row["base_denoise_s"])
    summary = report["summary"]
    assert summary["psnr_mean"] == pytest.approx(row["psnr"]) and summary["ssim_mean"] == pytest.approx(
        row["ssim"]
    )
    assert summary["denoise_ratio"] == pytest.approx(row["denoise_ratio"])
    assert (summary["base_prompt_following"], summary["candidate_prompt_following"]) == (0.5, 0.25)
    text = format_report(report)
    assert "ssim" in text and "prompt-following 0.50 (base) vs 0.25 (candidate)" in text
    assert "warm-up render of ball" in text


def test_exact_settings_are_sha_identical_in_ab(tmp_path, counted):
    counted.state["calls"] = 0
    result = run_ab(
        _config(tmp_path),
        sets=["step_cache=0", "cfg_truncation=1.0"],
        out_dir=tmp_path / "ab",
        show_progress=False,
        pipeline_factory=counted,
        prompt_scorer=lambda frames, prompt: {"score": 1.0},
        warmup=False,
        expect="lossless",
    )
    assert result.exit_code == 0 and result.report["all_sha_equal"]
    assert result.report["startup"] == {"base": None, "candidate": None}
    assert counted.state["calls"] == 2
    (row,) = result.report["jobs"]
    assert row["ssim"] == 1.0 and row["candidate_prompt_following"] == 1.0


def test_prompt_following_only_on_the_embedded_default_model(tmp_path, default_model_dir):
    called = []
    result = run_ab(
        _config(tmp_path, model=str(default_model_dir)),
        sets=["accel=fast"],
        out_dir=tmp_path / "ab",
        show_progress=False,
        prompt_scorer=lambda frames, prompt: called.append(prompt) or {"score": 1.0},
        warmup=False,
    )
    assert called == [] and result.report["declared"] == ["accel"]
    assert "base_prompt_following" not in result.report["jobs"][0]
    assert "base_follow" not in format_report(result.report)


TWO_JOBS = "  - {name: cube, prompt: a blue cube moves up, seed: 2}\n"


def _two_jobs_ab(tmp_path, counted, **options):
    """The two-job render file and its `ab` against cfg_truncation=0.5 (a constant prompt scorer)."""
    config = _config(tmp_path)
    config.write_text(config.read_text() + TWO_JOBS)
    result = run_ab(
        config,
        sets=["cfg_truncation=0.5"],
        out_dir=tmp_path / "ab",
        show_progress=False,
        pipeline_factory=counted,
        prompt_scorer=lambda frames, prompt: {"score": 1.0},
        **options,
    )
    return config, result


def test_cold_first_jobs_are_left_out_of_the_time_ratios(tmp_path, counted):
    """Without a warm-up the first timed job of each side pays start-up: it is recorded cold and the
    summary's ratios are those of the warm jobs only (the issue's 4.34 s vs 0.08 s first job)."""
    _, result = _two_jobs_ab(tmp_path, counted, warmup=False)
    first, second = result.report["jobs"]
    assert (first["cold"], second["cold"]) == (True, False)
    summary = result.report["summary"]
    assert (summary["jobs"], summary["timed_jobs"]) == (2, 1)
    assert summary["denoise_ratio"] == pytest.approx(second["denoise_ratio"])
    assert summary["time_ratio"] == pytest.approx(second["time_ratio"])
    assert "over 1 warmed jobs (1 cold job left out" in format_report(result.report)


def test_warmed_sides_time_every_job_and_a_reused_cold_baseline_stays_cold(tmp_path, counted):
    from mmgen.render.runner import run_render
    from mmgen.render.schema import load_render_file

    config, warmed = _two_jobs_ab(tmp_path, counted)
    assert [row["cold"] for row in warmed.report["jobs"]] == [False, False]
    assert warmed.report["summary"]["timed_jobs"] == 2
    # A baseline made by a plain render (no warm-up), then reused by ab: its first job stays cold.
    plan = load_render_file(config, output_dir=tmp_path / "reused" / "base")
    run_render(plan, save_frames=True, show_progress=False, pipeline_factory=counted)
    reused = run_ab(
        config,
        sets=["cfg_truncation=0.5"],
        out_dir=tmp_path / "reused",
        reuse=True,
        show_progress=False,
        pipeline_factory=counted,
        prompt_scorer=lambda frames, prompt: {"score": 1.0},
    )
    assert reused.report["startup"]["base"] is None  # nothing left to render on that side
    assert [row["cold"] for row in reused.report["jobs"]] == [True, False]
    assert reused.report["summary"]["timed_jobs"] == 1
