"""QwenImagePipeline.generate(request): the one request value in, as for the Wan pipelines.

`pipe(prompt, ...)` builds the GenerationRequest and calls generate, so the two are one path; a field
Qwen-Image cannot honour is refused by generate itself, one line naming it; and the faces (`mmgen
generate`, render YAML) reach the pipeline through generate, never through the keyword call.
"""

from __future__ import annotations

import json

import pytest
import torch

from mmgen.errors import ValidationError
from pipelines.qwen_image import QwenImagePipeline
from pipelines.request import GenerationRequest

COMMON = {"height": 32, "width": 48, "num_inference_steps": 2, "seed": 6}


@pytest.fixture(scope="module")
def ours(qwen_image_dir):
    return QwenImagePipeline.from_pretrained(qwen_image_dir, dtype=torch.float32)


def test_generate_is_the_python_call(ours):
    request = GenerationRequest.from_call(prompt="a red cat", negative_prompt="dark", **COMMON)
    by_request = ours.generate(request, progress=False)
    by_call = ours("a red cat", "dark", progress=False, **COMMON)
    assert by_request.frames_sha256 == by_call.frames_sha256
    assert by_request.latents_sha256 == by_call.latents_sha256
    assert by_request.args["guided"] is True and by_request.args["num_frames"] == 1
    # None for a field with a non-None default means its default, in the keyword call as for Wan
    assert (
        ours("a red cat", "dark", compile=None, progress=False, **COMMON).frames_sha256
        == by_call.frames_sha256
    )


@pytest.mark.parametrize(
    ("fields", "line"),
    [
        ({"num_frames": 5}, "num_frames = 5: Qwen-Image makes one image (1 frame)"),
        (
            {"step_cache": 0.1},
            "step_cache = 0.1: not supported by the Qwen-Image pipeline (no step cache yet)",
        ),
        ({"accel": "fast"}, "accel = 'fast': not supported by the Qwen-Image pipeline"),
        ({"decode": "tiled"}, "decode = 'tiled': not supported by the Qwen-Image pipeline"),
        ({"preset": "distill-4step"}, "preset = 'distill-4step': a Wan preset; this Qwen-Image model takes "),
    ],
)
def test_generate_refuses_with_one_line_naming_the_field(ours, fields, line):
    request = GenerationRequest.from_call(prompt="sky", **fields)
    for check in (lambda: ours.generate(request, progress=False), lambda: ours.check_request(request)):
        with pytest.raises(ValidationError) as caught:
            check()
        message = str(caught.value)
        assert message.startswith(line) and "\n" not in message, message
    if "preset" in fields:
        assert message.endswith("the presets lightning-8step, lightning-4step")


def test_a_qwen_preset_on_a_wan_model_names_the_wan_presets(default_model_dir):
    from mmgen.families import load_pipeline

    wan = load_pipeline(default_model_dir, task="t2v", device="cpu", dtype="float32")
    request = GenerationRequest.from_call(prompt="sky", preset="lightning-8step")
    with pytest.raises(ValidationError) as caught:
        wan.check_request(request)
    assert str(caught.value) == (
        "preset = 'lightning-8step': a Qwen-Image preset; this Wan model takes the presets distill-4step"
    )


def test_faces_reach_the_pipeline_through_generate(qwen_image_dir, tmp_path, monkeypatch, capsys):
    """With the keyword call gone, `mmgen generate` and a render still run (they call generate only)."""
    from mmgen.cli import main

    def no_keyword_call(self, *args, **kwargs):
        raise AssertionError("a face called pipe(**fields) instead of pipe.generate(request)")

    monkeypatch.setattr(QwenImagePipeline, "__call__", no_keyword_call)
    argv = ["generate", "--model", str(qwen_image_dir), "--out", str(tmp_path / "cat.png"), "--steps", "2"]
    assert (
        main([*argv, "--height", "32", "--width", "48", "--seed", "6", "--device", "cpu", "a red cat"]) == 0
    )
    printed = capsys.readouterr().out
    config = tmp_path / "render.yaml"
    config.write_text(
        f"model: {qwen_image_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 32, width: 48, num_frames: 1, num_inference_steps: 2}\n"
        "jobs:\n  - {name: cat, prompt: a red cat, seed: 6}\n"
    )
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    assert record["status"] == "ok" and f"frames_sha256: {record['frames_sha256']}" in printed
