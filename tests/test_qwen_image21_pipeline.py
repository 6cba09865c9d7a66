"""Qwen-Image-2.1's pipeline against diffusers' QwenImage21Pipeline on tiny random parts (CPU, fp32).

Latents: fp32 through the text encoder, a few denoising steps and the scheduler; the differences are
summation orders only (see test_qwen_image21_model), so 1e-5. Images: uint8 after the same VAE and
rounding; a latent difference of 1e-6 can move a pixel sitting on a rounding point by one level, so
images may differ by at most 1 (and the test reports how many do).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from qwen_image21_pipeline_cases import reference_pipeline, tiny_parts

from mmgen.attention.impls import SDPAImpl
from mmgen.errors import ValidationError
from mmgen.models.qwen_image21 import QwenImage21Config, QwenImage21Transformer
from pipelines.qwen_image21 import QwenImage21Pipeline

STEPS = 3


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    parts = tiny_parts(tmp_path_factory.mktemp("q21"))
    reference = reference_pipeline(parts)
    transformer = QwenImage21Transformer(QwenImage21Config.from_diffusers(dict(parts["transformer"].config)))
    transformer.load_state_dict(parts["transformer"].state_dict())
    ours = QwenImage21Pipeline(
        transformer=transformer.eval(),
        text_encoder=parts["text_encoder"],
        processor=parts["processor"],
        vae=parts["vae"],
        scheduler=type(parts["scheduler"]).from_config(parts["scheduler"].config),
        attention=SDPAImpl(),
    )
    return reference, ours


def _reference(reference, prompt, seed=0, **kwargs):
    generator = torch.Generator().manual_seed(seed)
    common = {"num_inference_steps": STEPS, "generator": generator, **kwargs}
    latents = reference(prompt, output_type="latent", **common).images
    common["generator"] = torch.Generator().manual_seed(seed)
    images = reference(prompt, output_type="np", **common).images
    return latents, (images * 255).round().astype(np.uint8)


def _check(ours, expected_latents, expected_images):
    torch.testing.assert_close(ours.latents, expected_latents, rtol=0, atol=1e-5)
    assert ours.images.shape == expected_images.shape
    diff = np.abs(ours.images.astype(int) - expected_images.astype(int))
    assert diff.max() <= 1, f"{int((diff > 0).sum())} values differ, max {diff.max()}"


def test_one_prompt_at_the_defaults(pipes):
    reference, ours = pipes
    expected = _reference(reference, "a red cat", height=64, width=64)
    _check(ours("a red cat", height=64, width=64, steps=STEPS, seed=0), *expected)


def test_negative_prompt_with_cfg_non_square(pipes):
    reference, ours = pipes
    kwargs = {"height": 64, "width": 96, "negative_prompt": "blurry", "true_cfg_scale": 4.0}
    expected = _reference(reference, "a dog at sea", seed=3, **kwargs)
    got = ours(
        "a dog at sea", height=64, width=96, negative_prompt="blurry", guidance=4.0, steps=STEPS, seed=3
    )
    _check(got, *expected)


def test_kv_cache_on_and_off(pipes):
    reference, ours = pipes
    on = ours("a tree", height=64, width=64, steps=STEPS, seed=1, use_kv_cache=True)
    off = ours("a tree", height=64, width=64, steps=STEPS, seed=1, use_kv_cache=False)
    torch.testing.assert_close(on.latents, off.latents, rtol=0, atol=1e-6)
    _check(on, *_reference(reference, "a tree", seed=1, height=64, width=64, use_kv_cache=True))
    _check(off, *_reference(reference, "a tree", seed=1, height=64, width=64, use_kv_cache=False))


def test_edit_with_one_condition_image(pipes):
    reference, ours = pipes
    pixels = (np.random.RandomState(0).rand(80, 64, 3) * 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    expected = _reference(reference, "make it blue", seed=2, image=image, output_resolution=64)
    got = ours("make it blue", image=image, resolution=64, steps=STEPS, seed=2)
    _check(got, *expected)


def test_two_prompts_of_different_lengths(pipes):
    """One packed call of two prompts equals diffusers on each prompt alone with the same noise rows."""
    reference, ours = pipes
    prompts = ["a cat", "a very long prompt about a small boat on a lake"]
    got = ours(prompts, height=64, width=64, steps=STEPS, seed=4)
    noise = torch.randn((2, 1, 16, 4, 4), generator=torch.Generator().manual_seed(4))
    packed = noise.reshape(2, 16, 16).transpose(1, 2)
    for b, prompt in enumerate(prompts):
        expected = _reference(reference, prompt, height=64, width=64, latents=packed[b : b + 1])
        _check(type(got)(got.images[b : b + 1], got.latents[b : b + 1]), *expected)


def test_size_not_a_multiple_of_32_is_refused(pipes):
    _, ours = pipes
    with pytest.raises(ValidationError, match="height=80"):
        ours("x", height=80, width=64, steps=1)


def test_loads_a_diffusers_directory_with_its_sample_sigmas(tmp_path):
    """A directory written part by part loads; its model_index.json's sample_sigmas set the schedule."""
    import diffusers
    from qwen_image21_pipeline_cases import write_qwen_image21_dir

    parts = tiny_parts(tmp_path)
    sigmas = [1.0, 0.8, 0.45]
    directory = write_qwen_image21_dir(tmp_path, parts, sigmas)
    ours = QwenImage21Pipeline.from_pretrained(directory, dtype=torch.float32, attention="sdpa")
    reference = diffusers.QwenImage21Pipeline(**parts, sample_sigmas=sigmas)
    reference.set_progress_bar_config(disable=True)
    expected = _reference(reference, "a kite", seed=5, height=64, width=64)
    _check(ours("a kite", height=64, width=64, seed=5), *expected)


def test_edit_with_two_condition_images_one_rgba(pipes):
    """Two condition images (the second RGBA: its alpha over white for the encoder, four channels for the VAE)."""
    reference, ours = pipes
    state = np.random.RandomState(1)
    first = Image.fromarray((state.rand(64, 96, 3) * 255).astype(np.uint8))
    second = Image.fromarray((state.rand(96, 64, 4) * 255).astype(np.uint8), mode="RGBA")
    expected = _reference(reference, "mix them", seed=6, image=[first, second], output_resolution=64)
    _check(ours("mix them", image=[first, second], resolution=64, steps=STEPS, seed=6), *expected)
