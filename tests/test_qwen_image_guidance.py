"""Qwen-Image's guidance without a negative prompt is not applied (true CFG needs one, as in diffusers):
never silently. `mmgen generate` prints one warning line and the result records it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from pipelines.qwen_image import QwenImagePipeline

COMMON = {"height": 32, "width": 48, "num_inference_steps": 2, "seed": 6}


@pytest.fixture(scope="module")
def ours(qwen_image_dir):
    return QwenImagePipeline.from_pretrained(qwen_image_dir, dtype=torch.float32)


def test_the_result_records_the_guidance_it_did_not_apply(ours):
    unguided = ours("a red cat", guidance_scale=5.0, progress=False, **COMMON)
    assert unguided.args["guided"] is False
    (warning,) = unguided.args["warnings"]
    assert warning.startswith("guidance_scale = 5 is not applied: true CFG needs a negative prompt")
    guided = ours("a red cat", " ", guidance_scale=5.0, progress=False, **COMMON)
    assert guided.args["guided"] is True and "warnings" not in guided.args
    assert "warnings" not in ours("a red cat", guidance_scale=1.0, progress=False, **COMMON).args


def test_generate_prints_one_warning_line(qwen_image_dir, tmp_path):
    script = shutil.which("mmgen")
    command = [script] if script else [sys.executable, "-m", "mmgen.cli"]
    flags = ["--height", "32", "--width", "48", "--steps", "2", "--device", "cpu", "--guidance", "5"]
    done = subprocess.run(
        [*command, "generate", "a red cat", "--model", str(qwen_image_dir), *flags, "--out", "cat.png"],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("mmgen: warning: ")]
    assert warnings == [
        "mmgen: warning: guidance_scale = 5 is not applied: true CFG needs a negative prompt "
        '(even " "); without one the image is made unguided'
    ], done.stderr
    assert "output: cat.png" in done.stdout and (tmp_path / "cat.png").is_file()
