"""mmgen's Wan pipelines against diffusers' WanPipeline on the same tiny components and noise.

The reference is assembled from the library classes themselves (diffusers WanTransformer3DModel,
AutoencoderKLWan and schedulers, transformers UMT5EncoderModel and tokenizer), loaded from the
embedded default model's directory; mmgen loads the same directory with its own loaders.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from wan_cases import diffusers_wan_pipeline

from pipelines.wan_t2i import WanT2IPipeline
from pipelines.wan_t2v import WanT2VPipeline

PROMPT = "a red fox running through a snowy forest at sunset"
NEGATIVE = "blurry dark"
# Max abs difference of final latents (up to ~3) from diffusers: the same math in other op orders
# and GEMM shapes (one batch-2 CFG call vs cond then uncond), fp32 rounding that 2-3 guided steps of
# the trained model carry to 1.3e-5 here; 1e-4 leaves room for a CPU whose BLAS rounds further.
LATENT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(default_model_dir):
    return diffusers_wan_pipeline(default_model_dir)


@pytest.fixture(scope="module")
def ours(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


def _noise(pipe: WanT2VPipeline, height: int, width: int, frames: int, seed: int = 7) -> torch.Tensor:
    shape = pipe.latents_shape(height, width, frames)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _reference_frames(reference, **kwargs) -> np.ndarray:
    # output_type="pil" is diffusers' own uint8 conversion ((x * 255).round()); stack it to [T, H, W, 3].
    return np.stack([np.asarray(image) for image in reference(output_type="pil", **kwargs).frames[0]])


@pytest.mark.parametrize(
    ("height", "width", "frames", "guidance"),
    [(32, 48, 5, 5.0), (48, 32, 5, 1.0)],  # CFG on (batched cond/uncond) and off; non-square sizes
)
def test_final_latents_match_diffusers(reference, ours, height, width, frames, guidance):
    noise = _noise(ours, height, width, frames)
    kwargs = dict(
        height=height, width=width, num_frames=frames, num_inference_steps=3, guidance_scale=guidance
    )
    result = ours(PROMPT, NEGATIVE, latents=noise, progress=False, **kwargs)
    expected = reference(PROMPT, NEGATIVE, latents=noise.clone(), output_type="latent", **kwargs).frames
    assert result.latents.shape == expected.shape
    diff = (result.latents - expected).abs().max().item()
    assert diff <= LATENT_TOLERANCE, f"max abs diff of final latents {diff:.3g}"
    assert expected.abs().max() > 0.5  # the comparison is not between two near-zero tensors


def test_decode_matches_diffusers_bit_for_bit(reference, ours):
    # Same final latents into both decoders: the uint8 frames must be identical, not merely close.
    kwargs = dict(height=48, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0)
    noise = _noise(ours, 48, 64, 5, seed=3)
    latents = reference(PROMPT, NEGATIVE, latents=noise.clone(), output_type="latent", **kwargs).frames
    expected = _reference_frames(
        reference, prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), **kwargs
    )
    frames = ours.decode(latents)
    assert frames.dtype == np.uint8 and frames.shape == (5, 48, 64, 3)
    np.testing.assert_array_equal(frames, expected)
    assert frames.std() > 3  # a non-trivial picture, not a constant (a 2-step render of the trained model)


def test_end_to_end_frames_match_diffusers(reference, ours):
    kwargs = dict(height=32, width=48, num_frames=5, num_inference_steps=2, guidance_scale=4.0)
    noise = _noise(ours, 32, 48, 5, seed=11)
    result = ours(PROMPT, NEGATIVE, latents=noise, progress=False, **kwargs)
    expected = _reference_frames(
        reference, prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), **kwargs
    )
    # Latents agree to ~1e-6; after the VAE a few values may land on the other side of a rounding edge.
    assert np.abs(result.frames.astype(int) - expected.astype(int)).max() <= 1
    assert (result.frames == expected).mean() > 0.999


def test_flow_match_euler_scheduler_matches_diffusers(reference, ours, default_model_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    c = ours.components
    pipe = WanT2VPipeline(c.transformer, c.text_encoder, c.tokenizer, c.vae, scheduler, defaults=c.defaults)
    ref = WanPipeline(
        tokenizer=reference.tokenizer,
        text_encoder=reference.text_encoder,
        vae=reference.vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=reference.transformer,
    )
    ref.set_progress_bar_config(disable=True)
    kwargs = dict(height=32, width=64, num_frames=5, num_inference_steps=3, guidance_scale=3.0)
    noise = _noise(pipe, 32, 64, 5, seed=5)
    result = pipe(PROMPT, latents=noise, progress=False, **kwargs)
    expected = ref(PROMPT, latents=noise.clone(), output_type="latent", **kwargs).frames
    assert (result.latents - expected).abs().max().item() <= LATENT_TOLERANCE


def test_t2i_is_the_one_frame_video(reference, ours):
    c = ours.components
    t2i = WanT2IPipeline(c.transformer, c.text_encoder, c.tokenizer, c.vae, c.scheduler, defaults=c.defaults)
    kwargs = dict(height=48, width=64, num_inference_steps=2, guidance_scale=5.0)
    noise = _noise(t2i, 48, 64, 1, seed=2)
    image = t2i(PROMPT, NEGATIVE, latents=noise, progress=False, **kwargs)
    expected = reference(
        PROMPT, NEGATIVE, latents=noise.clone(), num_frames=1, output_type="latent", **kwargs
    )
    assert image.frames.shape == (1, 48, 64, 3) and image.image.shape == (48, 64, 3)
    assert (image.latents - expected.frames).abs().max().item() <= LATENT_TOLERANCE
