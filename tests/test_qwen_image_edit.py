"""QwenImageEditPipeline against diffusers' QwenImageEditPipeline on one tiny random Edit directory (CPU, fp32).

Both load the same diffusers-format directory (tests/qwen_image_edit_cases.py). The same input image,
prompt and seed must give the same image: final latents within 1e-5, uint8 images identical. diffusers
runs true CFG as two transformer calls per step; mmgen as one packed call (cond and uncond rows of
their own text lengths, both beside the same image tokens). The input image is resized to about
1024 x 1024 pixels whatever the output size (diffusers' rule), so each run VAE-encodes ~1M pixels.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions  # noqa: E402
from PIL import Image  # noqa: E402
from qwen_image_cases import write_qwen_image_dir  # noqa: E402
from qwen_image_edit_cases import reference_pipeline, write_qwen_image_edit_dir  # noqa: E402

from mmgen.cli import main  # noqa: E402
from mmgen.errors import LoadError, ValidationError  # noqa: E402
from mmgen.families import load_pipeline  # noqa: E402
from mmgen.loading.qwen_image_dir import read_qwen_model_index  # noqa: E402
from mmgen.outputs.writers import frames_sha256  # noqa: E402
from pipelines.image_input import read_image  # noqa: E402
from pipelines.qwen_image import QwenImagePipeline  # noqa: E402
from pipelines.qwen_image_edit import QwenImageEditPipeline, calculated_size  # noqa: E402
from pipelines.request import GenerationRequest  # noqa: E402

STEPS = 3
TOL = 1e-5
PLAIN = {
    "prompt": "make it blue",
    "negative_prompt": None,
    "seed": 7,
    "height": 64,
    "width": 64,
    "guidance": 4.0,
}
GUIDED = {
    "prompt": "turn the sky into a sunset, photo",
    "negative_prompt": "blurry",
    "seed": 11,
    "height": 48,
    "width": 80,
    "guidance": 3.5,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_qwen_image_edit_dir(tmp_path_factory.mktemp("qwen-edit"))


@pytest.fixture(scope="module")
def pixels():
    """A non-square input image (60 x 40), uint8 [H, W, 3]."""
    return (np.random.RandomState(0).rand(40, 60, 3) * 255).astype(np.uint8)


@pytest.fixture(scope="module")
def ours(model_dir):
    return QwenImageEditPipeline.from_pretrained(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(model_dir, ours):
    pipe = reference_pipeline(model_dir)
    # The tiny byte-level tokenizer's count of the Edit template's system prefix (Qwen's gives 64).
    pipe.prompt_template_encode_start_idx = ours.components.text_encoder.prefix_tokens
    return pipe


def _diffusers(reference, pixels, case):
    """diffusers' image (uint8 [H, W, 3]) and final latents [1, C, 1, H/8, W/8] for a case."""
    final = {}

    def keep_latents(pipe, step, timestep, values):
        final["latents"] = values["latents"]
        return values

    with torch.no_grad():
        image = reference(
            Image.fromarray(pixels),
            case["prompt"],
            negative_prompt=case["negative_prompt"],
            true_cfg_scale=case["guidance"],
            height=case["height"],
            width=case["width"],
            num_inference_steps=STEPS,
            generator=torch.Generator().manual_seed(case["seed"]),
            callback_on_step_end=keep_latents,
            output_type="pil",
        ).images[0]
    latents = reference._unpack_latents(
        final["latents"], case["height"], case["width"], reference.vae_scale_factor
    )
    return np.asarray(image), latents


def _ours(ours, pixels, case, **fields):
    return ours(
        case["prompt"],
        case["negative_prompt"],
        image=pixels,
        seed=case["seed"],
        height=case["height"],
        width=case["width"],
        guidance_scale=case["guidance"],
        num_inference_steps=STEPS,
        progress=False,
        **fields,
    )


@pytest.fixture(scope="module")
def plain_reference(reference, pixels):
    return _diffusers(reference, pixels, PLAIN)


def _check(result, image, latents):
    diff = (result.latents - latents).abs().max().item()
    assert diff <= TOL, diff
    assert result.frames.shape == (1, *image.shape)
    assert np.array_equal(result.image, image), np.abs(result.image.astype(int) - image).max()


def test_one_prompt_without_cfg(ours, pixels, plain_reference):
    image, latents = plain_reference
    result = _ours(ours, pixels, PLAIN)
    assert result.args["guided"] is False and result.args["variant"] == "edit"
    _check(result, image, latents)
    assert result.args["condition_size"] == [832, 1248]  # 60 x 40 at ~1024 x 1024, sides rounded to 32
    assert result.args["image_sha256"] == read_image(pixels).sha256
    assert result.args["template_prefix_tokens"] == ours.components.text_encoder.prefix_tokens
    assert set(result.timings) == {"text_encode", "image_encode", "denoise", "decode", "total"}


def test_negative_prompt_true_cfg_non_square(ours, reference, pixels):
    """True CFG with a negative prompt of another token length, 48 x 80: one packed call of batch 2 a
    step (each row its text, then 3 x 5 noise and 52 x 78 image tokens), as diffusers' two calls."""
    image, latents = _diffusers(reference, pixels, GUIDED)
    seen = []
    hook = ours.transformer.register_forward_pre_hook(
        lambda module, args: seen.append(tuple(args[0].shape[:2]))
    )
    try:
        result = _ours(ours, pixels, GUIDED)
    finally:
        hook.remove()
    assert seen == [(2, 3 * 5 + 52 * 78)] * STEPS
    assert result.args["guided"] is True
    _check(result, image, latents)


def test_calculated_size_is_diffusers():
    for width, height in [(60, 40), (40, 60), (1024, 1024), (1000, 333), (7, 3000), (1920, 1080)]:
        image = read_image(np.zeros((height, width, 3), np.uint8))
        expected_width, expected_height, _ = calculate_dimensions(1024 * 1024, width / height)
        assert calculated_size(image) == (expected_height, expected_width)


def test_defaults_follow_the_input_image(ours, pixels):
    """No height/width: the output takes the input image's calculated size; the text cut at 1024."""
    request = ours.check_request(GenerationRequest.from_call(prompt="make it blue", image=pixels))
    assert (request.height, request.width, request.max_sequence_length) == (832, 1248, 1024)
    assert request.height * request.width == pytest.approx(1024 * 1024, rel=0.02)


def _one_line_error(check):
    with pytest.raises(ValidationError) as caught:
        check()
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def test_edit_without_an_image_is_refused(ours):
    request = GenerationRequest.from_call(prompt="make it blue", height=32, width=32)
    for check in (lambda: ours.check_request(request), lambda: ours.generate(request, progress=False)):
        message = _one_line_error(check)
        assert message.startswith("image: required by Qwen-Image-Edit (the image to edit: "), message


def test_an_image_too_thin_to_size_is_refused(ours):
    request = GenerationRequest.from_call(prompt="x", image=np.zeros((1, 5000, 3), np.uint8))
    message = _one_line_error(lambda: ours.check_request(request))
    assert message.startswith("image = 'array': 5000x1 (aspect 5e+03) resizes to "), message


def test_text_to_image_directory_refuses_an_image(tmp_path, pixels, model_dir):
    t2i = QwenImagePipeline.from_pretrained(write_qwen_image_dir(tmp_path), dtype=torch.float32)
    request = GenerationRequest.from_call(prompt="make it blue", image=pixels, height=32, width=32)
    message = _one_line_error(lambda: t2i.check_request(request))
    assert message == (
        "image = 'array': not supported by the Qwen-Image pipeline (this directory is Qwen-Image, "
        "text-to-image; an image to edit needs a Qwen-Image-Edit directory)"
    )
    with pytest.raises(
        LoadError, match="names QwenImageEditPipeline; QwenImagePipeline loads QwenImagePipeline"
    ):
        QwenImagePipeline.from_pretrained(model_dir)


def test_cli_generate_edits_an_image(model_dir, tmp_path, pixels, plain_reference, capsys):
    """`mmgen generate --model EDIT_DIR --image in.png "..."` writes the PNG diffusers makes."""
    source = tmp_path / "in.png"
    Image.fromarray(pixels).save(source)
    out = tmp_path / "edited.png"
    argv = ["generate", "--model", str(model_dir), "--image", str(source), "--out", str(out)]
    sizes = ["--height", str(PLAIN["height"]), "--width", str(PLAIN["width"]), "--steps", str(STEPS)]
    assert main([*argv, *sizes, "--seed", str(PLAIN["seed"]), "--device", "cpu", PLAIN["prompt"]]) == 0
    printed = capsys.readouterr().out
    written = np.asarray(Image.open(out))
    assert np.array_equal(written, plain_reference[0])
    assert f"frames_sha256: {frames_sha256(written[None])}" in printed
    assert f"image_sha256: {read_image(source).sha256}" in printed
    assert "size: input image 60x40 encoded at 1248x832 (its aspect ratio at ~1048576 pixels" in printed
    assert math.prod(written.shape[:2]) == PLAIN["height"] * PLAIN["width"]


def test_load_pipeline_picks_edit_and_checks_the_processor(model_dir, tmp_path):
    pipe = load_pipeline(model_dir, task="t2i", device="cpu", dtype="float32")
    assert type(pipe) is QwenImageEditPipeline and pipe.makes_video is False
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    index = json.loads((broken / "model_index.json").read_text())
    del index["processor"]
    (broken / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="processor must be \\[library, class\\], got None"):
        read_qwen_model_index(broken)
