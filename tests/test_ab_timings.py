"""`mmgen ab`'s timings come with their spread, and a warning where they cannot carry a speed-up claim:
too few timed jobs (no estimate of the spread) or per-job ratios too far apart (noise)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

from mmgen.render.ab import MIN_TIMED_JOBS, NOISY_SPREAD, format_report, summarize


def rows(*pairs: tuple[float, float]) -> list[dict]:
    """A/B rows of equal frames with (baseline, candidate) job and denoise seconds."""
    return [
        {
            "job": f"job{index}",
            "sha_equal": True,
            "psnr": None,
            "ssim": 1.0,
            "base_s": base,
            "candidate_s": cand,
            "time_ratio": cand / base,
            "base_denoise_s": base / 2,
            "candidate_denoise_s": cand / 2,
            "denoise_ratio": cand / base,
            "max_abs": 0,
            "mean_abs": 0.0,
        }
        for index, (base, cand) in enumerate(pairs)
    ]


def report_of(job_rows: list[dict]) -> str:
    report = {
        "baseline": "a.yaml",
        "candidate": "b.yaml",
        "declared": ["attention_backend"],
        "refused": False,
        "undeclared_differences": {},
        "failed_jobs": [],
        "jobs": job_rows,
        "summary": summarize(job_rows),
        "expect": None,
    }
    return format_report(report)


def test_one_noisy_baseline_run_is_not_a_speed_up():
    # the case: one job, its baseline run 10x slower than the candidate's
    summary = summarize(rows((10.0, 1.0)))
    assert summary["time_ratio"] == 0.1 and summary["time_ratio_range"] == [0.1, 0.1]
    assert summary["timing_warning"].startswith("1 timed job: too few to call a speed-up")
    assert "WARNING timings: 1 timed job: too few" in report_of(rows((10.0, 1.0)))
    assert MIN_TIMED_JOBS == 3


def test_steady_ratios_are_reported_with_their_spread_and_no_warning():
    steady = rows((2.0, 1.0), (2.1, 1.02), (1.96, 1.0))
    summary = summarize(steady)
    low, high = summary["time_ratio_range"]
    assert low == 1.02 / 2.1 and high == 1.0 / 1.96 and summary["timing_warning"] is None
    text = report_of(steady)
    assert f"(per job {low:.2f}x-{high:.2f}x)" in text and "WARNING" not in text


def test_ratios_far_apart_are_too_noisy():
    noisy = rows((2.0, 1.0), (1.0, 1.0), (2.0, 1.1))
    summary = summarize(noisy)
    assert summary["time_ratio_range"] == [0.5, 1.0] and 1.0 / 0.5 > NOISY_SPREAD
    assert "range 0.50x-1.00x" in summary["timing_warning"] and "too noisy" in summary["timing_warning"]
    # cold jobs (start-up in their time) are neither in the ratios nor in the count
    cold = [{**row, "cold": True} for row in rows((9.0, 1.0))]
    assert summarize(cold + rows((2.0, 1.0)) * 3)["timed_jobs"] == 3


def test_mmgen_ab_warns_about_a_single_timed_job(mmgen_cache_dir, tmp_path):
    config = tmp_path / "one.yaml"
    config.write_text(
        textwrap.dedent(
            """\
            model: default
            device: cpu
            dtype: float32
            defaults: {height: 32, width: 48, num_frames: 5, num_inference_steps: 2, max_sequence_length: 16}
            jobs:
              - {name: cat, prompt: a red circle moves right on a black background, seed: 1}
            """
        )
    )
    script = shutil.which("mmgen")
    command = [script] if script else [sys.executable, "-m", "mmgen.cli"]
    done = subprocess.run(
        [*command, "ab", str(config), "--set", "attention_backend=sdpa", "--out", "ab", "--no-progress"],
        cwd=tmp_path,
        env={**os.environ, "MMGEN_CACHE_DIR": str(mmgen_cache_dir)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "WARNING timings: 1 timed job: too few to call a speed-up" in done.stdout, done.stdout
    summary = json.loads((tmp_path / "ab" / "ab_report.json").read_text())["summary"]
    assert summary["timing_warning"].startswith("1 timed job") and len(summary["time_ratio_range"]) == 2
