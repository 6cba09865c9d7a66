"""Qwen-Image-2.1 on the shared prepare -> run -> record (pipelines.qwen_image21_family) against the
standalone functions' pipeline (pipelines.qwen_image21, itself checked against diffusers in
test_qwen_image21_pipeline) on the same tiny random parts (CPU, fp32).

Both run the same modules; sequential CFG calls the model once per prompt (batch 1) where the standalone
packs both prompts into one call, so GEMM shapes and summation orders differ: latents agree to 1e-5 (as
the diffusers parity tests), pixels to one level (a value on a rounding point).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from qwen_image21_pipeline_cases import tiny_parts

from mmgen.attention.impls import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
from pipelines.qwen_image21 import QwenImage21Pipeline
from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

pytest.importorskip("diffusers")
STEPS = 3


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    from types import SimpleNamespace

    parts = tiny_parts(tmp_path_factory.mktemp("q21f"))
    transformer = QwenImage21Transformer(QwenImage21Config.from_diffusers(dict(parts["transformer"].config)))
    transformer.load_state_dict(parts["transformer"].state_dict())
    transformer = transformer.eval()
    standalone = QwenImage21Pipeline(
        transformer=transformer,
        text_encoder=parts["text_encoder"],
        processor=parts["processor"],
        vae=parts["vae"],
        scheduler=type(parts["scheduler"]).from_config(parts["scheduler"].config),
        attention=SDPAImpl(),
    )
    components = SimpleNamespace(
        transformer=transformer,
        text_encoder=parts["text_encoder"],
        processor=parts["processor"],
        vae=parts["vae"],
        scheduler=parts["scheduler"],
        sample_sigmas=None,
        source=None,
    )
    return standalone, QwenImage21FamilyPipeline(components, condition_resolution=64)


def _check(result, expected):
    latents = expected.latents  # packed [1, N, C]
    ours = result.latents.flatten(2).transpose(1, 2)
    torch.testing.assert_close(ours, latents, rtol=0, atol=1e-5)
    assert result.frames.shape == (1, *expected.images.shape[1:])
    assert result.frames.shape[-1] == 4  # RGBA
    diff = np.abs(result.frames[0].astype(int) - expected.images[0].astype(int))
    assert diff.max() <= 1


def test_text_to_image_matches_the_standalone_pipeline(pipes):
    standalone, pipe = pipes
    expected = standalone("a red cat", height=64, width=96, steps=STEPS, seed=0)
    result = pipe("a red cat", height=64, width=96, num_inference_steps=STEPS, seed=0, progress=False)
    _check(result, expected)
    assert result.args["variant"] == "t2i" and result.args["prefix_kv_cache"] is True
    assert set(result.timings) >= {"text_encode", "denoise", "decode"}


@pytest.mark.parametrize("cfg", ["batch", "sequential"])
def test_cfg_batched_and_sequential(pipes, cfg):
    standalone, pipe = pipes
    expected = standalone(
        "a dog at sea", negative_prompt="blurry", guidance=4.0, height=64, width=64, steps=STEPS, seed=3
    )
    result = pipe(
        "a dog at sea",
        "blurry",
        guidance_scale=4.0,
        cfg=cfg,
        height=64,
        width=64,
        num_inference_steps=STEPS,
        seed=3,
        progress=False,
    )
    _check(result, expected)
    assert result.args["guided"] is True


def test_edit_with_a_condition_image(pipes):
    """The size follows the image (its aspect at condition_resolution squared pixels, sides / 32)."""
    standalone, pipe = pipes
    pixels = (np.random.RandomState(0).rand(80, 64, 3) * 255).astype(np.uint8)
    from PIL import Image

    expected = standalone("make it blue", image=Image.fromarray(pixels), resolution=64, steps=STEPS, seed=2)
    result = pipe("make it blue", image=pixels, num_inference_steps=STEPS, seed=2, progress=False)
    _check(result, expected)
    assert result.args["variant"] == "edit"
    checked = pipe.check_request(pipe_request("x", image=pixels))
    assert (checked.height, checked.width) == (64, 64)  # 80 x 64 at 64 x 64 pixels, sides / 32


def test_refusals_name_the_field(pipes):
    _, pipe = pipes
    with pytest.raises(ValidationError, match="height = 80"):
        pipe("x", height=80, width=64, num_inference_steps=1, progress=False)
    with pytest.raises(ValidationError, match="num_frames"):
        pipe("x", num_frames=5, progress=False)


def pipe_request(prompt, **fields):
    from pipelines.request import GenerationRequest

    return GenerationRequest.from_call(prompt=prompt, **fields)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qwen_image21_pipeline_cases import write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21dir")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


def test_mmgen_generate_writes_the_rgba_png(model_dir, tmp_path, capsys):
    """A Qwen-Image-2.1 directory is detected by model_index.json (_class_name QwenImage21Pipeline) and
    `mmgen generate` writes its RGBA image; the PNG holds the in-process pipeline's pixels exactly."""
    from PIL import Image

    from mmgen.cli import main
    from mmgen.families import family_of

    directory = model_dir
    assert family_of(directory).name == "qwen-image-2.1"
    out = tmp_path / "kite.png"
    argv = ["generate", "--model", str(directory), "--out", str(out), "--steps", "2", "--height", "64"]
    argv += ["--width", "96", "--seed", "5", "--device", "cpu", "--dtype", "fp32", "a kite"]
    assert main(argv) == 0
    pipe = QwenImage21FamilyPipeline.from_pretrained(directory, dtype="float32")
    result = pipe("a kite", seed=5, height=64, width=96, num_inference_steps=2, progress=False)
    assert f"frames_sha256: {result.frames_sha256}" in capsys.readouterr().out
    with Image.open(out) as written:
        assert written.mode == "RGBA"
        np.testing.assert_array_equal(np.asarray(written), result.frames[0])


def test_render_yaml_job_equals_the_python_call(model_dir, tmp_path):
    """`mmgen render` over a Qwen-Image-2.1 directory (task t2i): the manifest identity is the call's."""
    import json

    from PIL import Image

    from mmgen.cli import main

    config = tmp_path / "render.yaml"
    config.write_text(
        f"model: {model_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 64, width: 64, num_frames: 1, num_inference_steps: 2}\n"
        "jobs:\n  - {name: dog, prompt: a dog, negative_prompt: dark, guidance_scale: 3.0, seed: 4}\n"
    )
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32")
    common = {"seed": 4, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 3.0}
    result = pipe("a dog", "dark", **common, progress=False)
    assert record["status"] == "ok", record
    assert record["frames_sha256"] == result.frames_sha256
    with Image.open(tmp_path / "out" / "dog_s4.png") as written:
        np.testing.assert_array_equal(np.asarray(written), result.frames[0])
