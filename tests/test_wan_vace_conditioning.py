"""pipelines.vace_conditioning against diffusers' WanVACEPipeline methods on tiny inputs (CPU, fp32).

The pipeline methods run unbound on a stand-in `self` holding what they read (a tiny random
AutoencoderKLWan, the VAE scale factors, the transformer's patch size), so no text encoder or
transformer is built.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, WanVACEPipeline
from diffusers.video_processor import VideoProcessor
from PIL import Image

from mmgen.errors import ValidationError
from pipelines.conditioning import encode_condition
from pipelines.vace_conditioning import packed_mask, reference_canvas, vace_control, video_latents

FRAMES, HEIGHT, WIDTH = 9, 16, 32  # 9 frames -> 3 latent frames; non-square


@pytest.fixture(scope="module")
def vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[0.5, 1.5, 2.0, 1.0],
    ).eval()


def stand_in(vae) -> SimpleNamespace:
    """What WanVACEPipeline's prepare_* / preprocess_conditions read from self."""
    return SimpleNamespace(
        vae=vae,
        _execution_device=torch.device("cpu"),
        vae_scale_factor_temporal=4,
        vae_scale_factor_spatial=8,
        video_processor=VideoProcessor(vae_scale_factor=8),
        transformer=SimpleNamespace(config=SimpleNamespace(patch_size=(1, 2, 2))),
    )


def encoder(vae):
    pipeline = SimpleNamespace(vae=vae, device=torch.device("cpu"))
    return lambda pixels: encode_condition(pipeline, pixels)


def inputs(channels: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    video = torch.rand(1, 3, FRAMES, HEIGHT, WIDTH, generator=gen) * 2 - 1
    mask = torch.rand(1, channels, FRAMES, HEIGHT, WIDTH, generator=gen)
    references = [torch.rand(3, HEIGHT, WIDTH, generator=gen) * 2 - 1 for _ in range(2)]
    return video, mask, references


@pytest.mark.parametrize("count", [0, 1, 2])
@pytest.mark.parametrize("channels", [1, 3])
def test_control_matches_diffusers(vae, count, channels):
    video, mask, references = inputs(channels)
    references = references[:count]
    wide = mask.expand(1, 3, *mask.shape[2:])  # diffusers' masks are RGB
    pipe = stand_in(vae)
    # diffusers puts the last reference first; mmgen keeps the order given (the original VACE code's,
    # test_references_keep_the_order_given): diffusers gets the list reversed
    reversed_references = references[::-1]
    with torch.no_grad():
        expected_latents = WanVACEPipeline.prepare_video_latents(
            pipe, video, wide, [reversed_references], None, "cpu"
        )
        expected_mask = WanVACEPipeline.prepare_masks(pipe, wide, [reversed_references], None)
        latents = video_latents(encoder(vae), video, mask, references)
        control = vace_control(encoder(vae), video, mask, references)
    assert latents.shape == expected_latents.shape == (1, 8, count + 3, 2, 4)
    assert (latents - expected_latents).abs().max().item() <= 1e-5
    assert torch.equal(packed_mask(mask, count), expected_mask)
    assert control.references == count
    assert control.latents.shape == (1, 8 + 64, count + 3, 2, 4)
    assert torch.equal(control.latents[:, 8:], expected_mask)
    assert (control.latents[:, :8] - expected_latents).abs().max().item() <= 1e-5
    denoised = torch.randn(2, 4, count + 3, 2, 4)
    assert torch.equal(control.drop_references(denoised), denoised[:, :, count:])


def test_references_keep_the_order_given(vae):
    """The original VACE code (Wan2.1 wan/vace.py, vace_encode_frames) concatenates [*references, video]
    in time: reference i is latent frame i, each with a zero reactive half."""
    video, mask, references = inputs(1)
    encode = encoder(vae)
    with torch.no_grad():
        latents = video_latents(encode, video, mask, references)
        alone = [encode(reference[None, :, None]) for reference in references]
        plain = video_latents(encode, video, mask)
    assert not torch.equal(alone[0], alone[1])
    for index, latent in enumerate(alone):
        assert torch.equal(latents[:, :4, index : index + 1], latent)
        assert not latents[:, 4:, index].any()
    assert torch.equal(latents[:, :, len(references) :], plain)


def test_rgb_mask_channels_as_diffusers(vae):
    """An RGB mask with unequal channels: each channel splits its own pixels; the packed mask reads channel 0."""
    video, mask, _ = inputs(3, seed=2)
    pipe = stand_in(vae)
    with torch.no_grad():
        expected = WanVACEPipeline.prepare_video_latents(pipe, video, mask, [[]], None, "cpu")
        latents = video_latents(encoder(vae), video, mask)
    assert (latents - expected).abs().max().item() <= 1e-5
    assert torch.equal(packed_mask(mask), WanVACEPipeline.prepare_masks(pipe, mask, [[]], None))


@pytest.mark.parametrize("size", [(24, 40), (40, 16), (16, 32)], ids=["wide", "tall", "same-aspect"])
def test_reference_canvas_matches_diffusers(vae, size):
    height, width = size
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    _, _, expected = WanVACEPipeline.preprocess_conditions(
        stand_in(vae), None, None, Image.fromarray(pixels), 1, HEIGHT, WIDTH, FRAMES, torch.float32, "cpu"
    )
    image = torch.from_numpy(pixels.astype(np.float32) / 255.0).permute(2, 0, 1) * 2 - 1
    canvas = reference_canvas(image, HEIGHT, WIDTH)
    assert canvas.shape == expected[0][0].shape == (3, HEIGHT, WIDTH)
    assert (canvas - expected[0][0]).abs().max().item() <= 1e-6


def test_bad_shapes_raise(vae):
    video, mask, references = inputs(1)
    with pytest.raises(ValidationError, match="mask must be"):
        video_latents(encoder(vae), video, mask[:, :, :5])
    with pytest.raises(ValidationError, match="reference image must be a canvas"):
        video_latents(encoder(vae), video, mask, [references[0][:, :8]])
    with pytest.raises(ValidationError, match="multiples of 16"):
        packed_mask(torch.ones(1, 1, FRAMES, 24, 32))
