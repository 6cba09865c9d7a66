"""The VAE decode split over ranks (mmgen.parallel.vae_decode): spatial bands with a recomputed halo.

In one process: the band loop on one rank is diffusers' decode bit for bit; bands of 2 and 3 ranks
concatenated equal it within fp32 rounding; a shorter halo does not (the halo is needed, and the
comparison can fail); the halos read off the real Wan2.1 VAE. On forked gloo worlds of 2 and 4
processes: the gathered frames equal the one-process decode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import parallel_workers
import pytest
import torch

from mmgen.errors import ValidationError
from mmgen.parallel.layout import ParallelConfig
from mmgen.parallel.vae_decode import decode_in_bands, decoder_halos, plan_bands
from pipelines.common import video_to_uint8

FLOAT_TOLERANCE = 1e-5  # conv rounding of narrower tensors (oneDNN picks its algorithm by shape)


@pytest.fixture(scope="module")
def reference():
    vae, z = parallel_workers.tiny_vae(), parallel_workers.vae_latents()
    with torch.no_grad():
        video = vae.decode(z, return_dict=False)[0]
    return vae, z, parallel_workers.float_frames(video), video_to_uint8(video)


def _bands(vae, z, plan, convert=parallel_workers.float_frames) -> np.ndarray:
    return decode_in_bands(vae, z, plan, convert)


def _uint8_close(got: np.ndarray, expected: np.ndarray) -> None:
    # Values within 1e-5 round to the same uint8 unless they sit on a rounding boundary: at most 1 level, rarely.
    assert got.shape == expected.shape and got.dtype == np.uint8
    diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= 1 and (diff > 0).mean() < 1e-3


def test_one_rank_is_diffusers_decode_bit_for_bit(reference):
    vae, z, expected, _ = reference
    plan = plan_bands(vae, tuple(z.shape), 1)
    assert plan.bands == ((0, 32),) and plan.axis == 4  # W' > H': bands of the width
    np.testing.assert_array_equal(_bands(vae, z, plan), expected)  # same shapes, same ops


@pytest.mark.parametrize("ranks", [2, 3])
def test_bands_equal_the_whole_decode(reference, ranks):
    vae, z, expected, expected_uint8 = reference
    plan = plan_bands(vae, tuple(z.shape), ranks)
    assert [end - start for start, end in plan.bands] == [
        32 // ranks + (r < 32 % ranks) for r in range(ranks)
    ]
    np.testing.assert_allclose(_bands(vae, z, plan), expected, rtol=0, atol=FLOAT_TOLERANCE)
    _uint8_close(_bands(vae, z, plan, video_to_uint8), expected_uint8)
    assert all(plan.work_fraction(r) < 1 for r in range(ranks))


def test_a_shorter_halo_breaks_the_band_edges(reference):
    vae, z, expected, _ = reference
    plan = plan_bands(vae, tuple(z.shape), 2)
    assert plan.halos[0] + 16 < 32  # the halo ends inside the frame: its outer rows are wrong
    errors = [
        np.abs(
            _bands(vae, z, dataclasses.replace(plan, halos=(plan.halos[0] - k, *plan.halos[1:]))) - expected
        ).max()
        for k in range(3)
    ]
    # The wrong rows reach the band through the corner of the receptive field (small weights): one
    # row short shows above the rounding, two rows short far above the tolerance.
    assert errors[0] <= FLOAT_TOLERANCE and errors[1] > errors[0] and errors[2] > 5 * FLOAT_TOLERANCE


def test_halos_of_the_wan21_vae_and_refusals():
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        wan21 = AutoencoderKLWan()  # the Wan2.1 VAE's architecture (diffusers' defaults)
    # backwards from conv_out (1 row): 6 convs per up block, each 2x upsample halves the rows (ceil)
    assert decoder_halos(wan21.decoder, 4) == ((13, 12, 10, 7, 1), (1, 2, 4, 8, 8))
    plan = plan_bands(wan21, (1, 16, 21, 90, 160), 8)  # 720 x 1280
    assert plan.axis == 4 and plan.pixels == 8 and plan.work_fraction(3) < 0.14
    with pytest.raises(ValidationError, match="4 latent positions do not split over 8 ranks"):
        plan_bands(wan21, (1, 16, 3, 4, 4), 8)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world_frames(request):
    return parallel_workers.run_forked(parallel_workers.split_decode_frames, ParallelConfig(sp=request.param))


def test_gloo_world_split_decode_equals_one_process(world_frames, reference):
    _, _, expected, expected_uint8 = reference
    got, got_uint8 = world_frames
    np.testing.assert_allclose(got, expected, rtol=0, atol=FLOAT_TOLERANCE)
    _uint8_close(got_uint8, expected_uint8)
