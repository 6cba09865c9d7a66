"""video_to_uint8: the VAE's output in [-1, 1] -> uint8 frames, bit for bit diffusers' VideoProcessor path to
PIL (postprocess_video to float32 numpy, then numpy_to_pil's * 255, round, uint8), on the CPU and, where
there is one, on a GPU (the conversion runs where the frames are: each step one IEEE float32 rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.common import video_to_uint8

diffusers = pytest.importorskip("diffusers")


def decoded_video(dtype: torch.dtype) -> torch.Tensor:
    """[1, 3, T, H, W] in and beyond [-1, 1], its first values on every rounding point (k + 0.5) / 255."""
    generator = torch.Generator().manual_seed(0)
    video = torch.rand(1, 3, 5, 33, 47, generator=generator) * 2.4 - 1.2
    levels = torch.arange(255, dtype=torch.float32)
    video.view(-1)[:255] = (levels + 0.5) / 255 * 2 - 1
    return video.to(dtype)


def diffusers_frames(video: torch.Tensor) -> np.ndarray:
    from diffusers.video_processor import VideoProcessor

    # postprocess: (x / 2 + 0.5).clamp(0, 1) in the video's dtype, then float32 numpy
    floats = VideoProcessor(do_resize=False).postprocess_video(video, output_type="np")[0]
    return (floats * 255).round().astype("uint8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_equal_diffusers_postprocess(dtype):
    video = decoded_video(dtype)
    frames = video_to_uint8(video)
    assert frames.dtype == np.uint8 and frames.shape == (5, 33, 47, 3)
    assert np.array_equal(frames, diffusers_frames(video))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frames_on_cuda_equal_the_cpu_bits(dtype):
    video = decoded_video(dtype)
    assert np.array_equal(video_to_uint8(video.cuda()), video_to_uint8(video))
