"""The trainer's conventions agree with what the pipeline does at inference (no training needed to check)."""

from __future__ import annotations

import torch

from pipelines.tiny_world import data
from pipelines.wan_t2v import WanT2VPipeline


def test_flow_target_is_what_the_shipped_scheduler_integrates(default_model_dir):
    # The exact velocity for one known clean latent x0, in the trainer's convention: at sigma s the
    # input is x_s = (1 - s) x0 + s eps, the timestep 1000 s, the target eps - x0 = (x_s - x0) / s.
    # Sampling with the directory's scheduler and that velocity must land on x0.
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    scheduler = type(pipe.components.scheduler).from_config(pipe.components.scheduler.config)
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 8, 3, 12, 12, generator=generator)
    noise = torch.randn(x0.shape, generator=generator)

    def sample(sign: float) -> torch.Tensor:
        scheduler.set_timesteps(pipe.defaults.num_inference_steps)
        x = noise
        for t in scheduler.timesteps:
            sigma = float(t) / data.TIMESTEPS
            x = scheduler.step(sign * (x - x0) / sigma, t, x, return_dict=False)[0]
        return x

    # Within the float32 rounding of the timesteps (a few 1e-3); the opposite sign lands far away.
    torch.testing.assert_close(sample(1.0), x0, atol=1e-2, rtol=0)
    assert (sample(-1.0) - x0).abs().mean() > 0.5
    # Training noise levels cover the schedule's range, shifted towards noise as the scheduler's are.
    sigmas = data.shifted_sigmas(torch.linspace(0.01, 0.99, 99))
    assert sigmas.min() < scheduler.sigmas[-2] and sigmas.max() > scheduler.sigmas[0] - 0.01
    assert float(data.shifted_sigmas(torch.tensor(0.5))) == data.FLOW_SHIFT * 0.5 / (
        1 + (data.FLOW_SHIFT - 1) * 0.5
    )


def test_short_text_batches_equal_the_pipelines_padded_encoding(default_model_dir):
    pipe = WanT2VPipeline.from_pretrained(default_model_dir)
    prompts = ["a red circle moves left on a black background", ""]
    expected, _ = pipe.encode_text(prompts, pipe.transformer.config.text_len)
    ids, lengths = data.tokenize(pipe.components.tokenizer, prompts)
    with torch.no_grad():
        got = data.encode_text(pipe.components.text_encoder, ids, lengths, pipe.transformer.config.text_len)
    assert got.shape == expected.shape == (2, 512, 64)
    # short batches vs 512 padded tokens: other GEMM and attention shapes, fp32 rounding of O(1) values
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
