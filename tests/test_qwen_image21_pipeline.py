"""Qwen-Image-2.1's family pipeline (pipelines.qwen_image21_family: the shared prepare -> run -> record)
against diffusers' QwenImage21Pipeline on tiny random parts (CPU, fp32).

Every case runs through `pipe.generate(request)` (the Python call builds the request), except two
prompts in one call: a request has one prompt (and a negative one), so that case drives the family's
own hooks (encode_text, conditioning, call) and its scheduler in a loop written here.

Latents: fp32 through the text encoder, a few denoising steps and the scheduler; the differences are
summation orders only (see test_qwen_image21_model), so 1e-5. Images: uint8 after the same VAE and
diffusers' rounding; a latent difference of 1e-6 can move a pixel whose value sits on a rounding point
(x.5 levels) by one level, so a pixel may differ by one level only where diffusers' own value is
within ROUNDING_POINT of x.5 (checked, and the count reported on failure).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_image21_pipeline_cases import family_pipeline, reference_pipeline, tiny_parts

from mmgen.errors import ValidationError
from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

pytest.importorskip("diffusers")
STEPS = 3
RESOLUTION = 64  # diffusers' output_resolution: condition images at about 64 x 64 pixels
# How close to x.5 levels diffusers' value must be for a one-level difference to be a rounding point.
ROUNDING_POINT = 0.02


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    parts = tiny_parts(tmp_path_factory.mktemp("q21"))
    reference = reference_pipeline(parts)
    return reference, family_pipeline(parts, RESOLUTION)


def _reference(reference, prompt, seed=0, **kwargs):
    """diffusers' packed latents [1, N, C] and its images as float levels [1, H, W, 4] (before rounding)."""
    common = {"num_inference_steps": STEPS, "generator": torch.Generator().manual_seed(seed), **kwargs}
    if kwargs.get("image") is not None:
        common["output_resolution"] = RESOLUTION
    latents = reference(prompt, output_type="latent", **common).images
    common["generator"] = torch.Generator().manual_seed(seed)
    return latents, reference(prompt, output_type="np", **common).images * 255


def _check_images(ours: np.ndarray, levels: np.ndarray) -> None:
    """uint8 `ours` equal to diffusers' rounding of `levels`, but one level where it sits on x.5."""
    expected = levels.round().astype(int)
    assert ours.shape == expected.shape
    diff = np.abs(ours.astype(int) - expected)
    on_point = np.abs(np.abs(levels - np.floor(levels)) - 0.5) <= ROUNDING_POINT
    moved = diff > 0
    assert diff.max() <= 1 and not (moved & ~on_point).any(), (
        f"{int(moved.sum())} values differ (max {diff.max()}), {int((moved & ~on_point).sum())} of them "
        "not on a rounding point"
    )


def _check(result, expected_latents, levels):
    ours = result.latents.flatten(2).transpose(1, 2)  # [1, C, 1, h, w] -> packed [1, N, C]
    torch.testing.assert_close(ours, expected_latents, rtol=0, atol=1e-5)
    assert result.frames.shape[-1] == 4  # RGBA
    _check_images(result.frames, levels)


def _run(pipe, prompt, negative=None, **fields):
    return pipe(prompt, negative, num_inference_steps=STEPS, progress=False, **fields)


def test_one_prompt_at_the_defaults(pipes):
    reference, pipe = pipes
    expected = _reference(reference, "a red cat", height=64, width=64)
    result = _run(pipe, "a red cat", height=64, width=64, seed=0)
    _check(result, *expected)
    assert result.args["variant"] == "t2i" and result.args["guided"] is False
    assert result.args["prefix_kv_cache"] is True
    assert set(result.timings) >= {"text_encode", "denoise", "decode"}


@pytest.mark.parametrize("cfg", ["batch", "sequential"])
def test_negative_prompt_with_cfg_non_square(pipes, cfg):
    """Batched CFG packs both prompts (different lengths) into one call; sequential calls once per prompt."""
    reference, pipe = pipes
    kwargs = {"height": 64, "width": 96, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    expected = _reference(reference, "a dog at sea", seed=3, **kwargs)
    result = _run(pipe, "a dog at sea", "blurry", guidance_scale=4.0, cfg=cfg, height=64, width=96, seed=3)
    _check(result, *expected)
    assert result.args["guided"] is True


def test_prefix_cache_on_and_off(pipes):
    """The cached prefix on (the default) and off (the request's no_prefix_cache) agree within 1e-6, each
    equal to diffusers' with use_kv_cache on and off."""
    reference, pipe = pipes
    on = _run(pipe, "a tree", height=64, width=64, seed=1)
    off = _run(pipe, "a tree", height=64, width=64, seed=1, no_prefix_cache=True)
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=1e-6)
    assert on.args["prefix_kv_cache"] is True and off.args["prefix_kv_cache"] is False
    assert on.args["no_prefix_cache"] is False and off.args["no_prefix_cache"] is True  # recorded
    _check(on, *_reference(reference, "a tree", seed=1, height=64, width=64, use_kv_cache=True))
    _check(off, *_reference(reference, "a tree", seed=1, height=64, width=64, use_kv_cache=False))


def test_edit_with_one_condition_image(pipes):
    """The size follows the image: 80 x 64 at 64 x 64 pixels, sides / 32 -> 64 x 64."""
    reference, pipe = pipes
    pixels = (np.random.RandomState(0).rand(80, 64, 3) * 255).astype(np.uint8)
    expected = _reference(reference, "make it blue", seed=2, image=Image.fromarray(pixels))
    result = _run(pipe, "make it blue", image=pixels, seed=2)
    _check(result, *expected)
    assert result.args["variant"] == "edit" and result.frames.shape == (1, 64, 64, 4)


def test_edit_with_two_condition_images_one_rgba(pipes, tmp_path):
    """Two condition images, the second an RGBA PNG file: its alpha over white for the text encoder,
    all four channels for the VAE (the file's alpha is kept)."""
    reference, pipe = pipes
    state = np.random.RandomState(1)
    first = (state.rand(64, 96, 3) * 255).astype(np.uint8)
    second = (state.rand(96, 64, 4) * 255).astype(np.uint8)
    path = tmp_path / "second.png"
    Image.fromarray(second, mode="RGBA").save(path)
    images = [Image.fromarray(first), Image.fromarray(second, mode="RGBA")]
    expected = _reference(reference, "mix them", seed=6, image=images)
    result = _run(pipe, "mix them", image=[first, str(path)], seed=6)
    _check(result, *expected)
    assert result.frames.shape == (1, 64, 64, 4)  # 96 x 64 at 64 x 64 pixels, sides / 32
    assert len(result.args["image_sha256"]) == 2 and result.args["image"] == ["array", str(path)]


def test_two_prompts_of_different_lengths_in_one_call(pipes):
    """The family's hooks with two prompts as two samples of one packed call (no padding): each prompt's
    latents equal diffusers' for that prompt alone with the same noise row. A request has one prompt,
    so this drives encode_text, conditioning (its `both` branch), call and the scheduler directly."""
    from pipelines.denoise import DenoiseModels
    from pipelines.plan import prepare
    from pipelines.request import GenerationRequest

    reference, pipe = pipes
    hooks, prompts = pipe.hooks, ["a cat", "a very long prompt about a small boat on a lake"]
    request = GenerationRequest.from_call(prompt=prompts[0], height=64, width=64, num_inference_steps=STEPS)
    plan = prepare(request.with_values(seed=4), pipe, seeded=False)
    noise = torch.randn((2, 1, 16, 4, 4), generator=torch.Generator().manual_seed(4))
    packed = noise.reshape(2, 16, 16).transpose(1, 2)  # [2, N, C], as initial_noise packs
    latents = packed
    text, text_lens = hooks.encode_text(pipe, plan, prompts, None)
    assert text_lens[0] < text_lens[1]
    conditioning = hooks.conditioning(pipe, plan, text, text_lens, None, latents)
    scheduler = hooks.scheduler(pipe, plan.request)
    models = DenoiseModels(
        experts=pipe.experts,
        attention=plan.attention,
        layout=pipe.layout,
        placement=pipe.arrange(plan),
        dtype=pipe.dtype,
        settings=plan.settings,
        call=hooks.call,
        guide=hooks.guide,
    )
    for step in plan.steps:
        prediction = hooks.call(pipe.transformer, latents, step, conditioning.both, conditioning, models)
        latents = scheduler.step(prediction, step.timestep, latents, return_dict=False)[0]
    for b, prompt in enumerate(prompts):
        row = latents[b : b + 1].transpose(1, 2).reshape(1, 16, 1, 4, 4)
        expected_latents, levels = _reference(
            reference, prompt, height=64, width=64, latents=packed[b : b + 1]
        )
        torch.testing.assert_close(latents[b : b + 1], expected_latents, rtol=0, atol=1e-5)
        _check_images(pipe.decode(row), levels)


def test_size_not_a_multiple_of_32_is_refused(pipes):
    _, pipe = pipes
    with pytest.raises(ValidationError, match="height = 80"):
        _run(pipe, "x", height=80, width=64)


def test_loads_a_diffusers_directory_with_its_sample_sigmas(tmp_path):
    """A directory written part by part loads; its model_index.json's sample_sigmas set the schedule."""
    import diffusers
    from qwen_image21_pipeline_cases import write_qwen_image21_dir

    parts = tiny_parts(tmp_path)
    sigmas = [1.0, 0.8, 0.45]
    directory = write_qwen_image21_dir(tmp_path, parts, sigmas)
    pipe = QwenImage21FamilyPipeline.from_pretrained(directory, dtype="float32")
    reference = diffusers.QwenImage21Pipeline(**parts, sample_sigmas=sigmas)
    reference.set_progress_bar_config(disable=True)
    expected = _reference(reference, "a kite", seed=5, height=64, width=64)
    _check(_run(pipe, "a kite", height=64, width=64, seed=5), *expected)
