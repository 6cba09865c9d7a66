"""WanT2VPipeline / WanT2IPipeline behaviour: validation before work, seeds, progress, result record."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mmgen.errors import ValidationError
from pipelines.wan_t2i import WanT2IPipeline
from pipelines.wan_t2v import WanT2VPipeline

SMALL = dict(height=32, width=48, num_frames=5, num_inference_steps=2)


class Recorder:
    """A ProgressReporter that remembers what it was told."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.closed = False

    def stage(self, name: str, total: int) -> None:
        self.events.append((name, total))

    def advance(self, units: int = 1) -> None:
        self.events.append(("+", units))

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def pipe(default_model_dir):
    return WanT2VPipeline.from_pretrained(default_model_dir)


@pytest.fixture()
def dit_calls(pipe):
    calls = []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(num_frames=10), ("num_frames", "10", "4k+1")),  # the request value: 4k+1 on every face
        (dict(height=100), ("height", "100", "multiple of 16")),
        (dict(width=40), ("width", "40", "multiple of 16")),
        (dict(num_inference_steps=0), ("num_inference_steps", "0", "[1, 1000]")),
        (dict(guidance_scale=-1.0), ("guidance_scale", "-1.0", ">= 0")),
        (dict(attention_backend="nope"), ("attention_backend", "'nope'", "sdpa")),
        (dict(seed=1, generator=torch.Generator()), ("seed", "generator")),
        (dict(latents=torch.zeros(1, 4, 1, 4, 6)), ("latents", "(1, 8, 3, 8, 12)")),
    ],
)
def test_bad_request_is_refused_before_any_work(pipe, dit_calls, kwargs, names):
    progress = Recorder()
    with pytest.raises(ValidationError) as info:
        pipe("a cat", progress=progress, **{**SMALL, **kwargs})
    message = str(info.value)
    assert "\n" not in message
    for name in names:
        assert name in message
    assert dit_calls == [] and progress.events == []


def test_defaults_come_from_the_model_directory(pipe):
    result = pipe("a cat", seed=0, progress=False, num_inference_steps=1)
    d = pipe.defaults
    assert result.frames.shape == (d.num_frames, d.height, d.width, 3)
    assert result.args["guidance_scale"] == d.guidance_scale and result.args["fps"] == d.fps


def test_seed_generator_and_latents_give_the_same_output(pipe):
    by_seed = pipe("a dog", seed=5, progress=False, **SMALL)
    by_generator = pipe("a dog", generator=torch.Generator().manual_seed(5), progress=False, **SMALL)
    noise = torch.randn(pipe.latents_shape(32, 48, 5), generator=torch.Generator().manual_seed(5))
    by_latents = pipe("a dog", latents=noise, progress=False, **SMALL)
    assert by_seed.frames_sha256 == by_generator.frames_sha256 == by_latents.frames_sha256
    assert by_seed.latents_sha256 == by_latents.latents_sha256
    other = pipe("a dog", seed=6, progress=False, **SMALL)
    assert other.frames_sha256 != by_seed.frames_sha256
    assert by_seed.args["seed"] == 5 and by_latents.args["noise"] == "latents"


def test_no_seed_draws_one_and_records_it(pipe):
    first = pipe("a bird", progress=False, **SMALL)
    again = pipe("a bird", seed=first.args["seed"], progress=False, **SMALL)
    assert isinstance(first.args["seed"], int)
    assert again.frames_sha256 == first.frames_sha256


def test_result_record(pipe):
    progress = Recorder()
    result = pipe("a red car", "blurry", seed=1, progress=progress, guidance_scale=3.0, **SMALL)
    assert result.frames.dtype == np.uint8 and result.frames.shape == (5, 32, 48, 3)
    assert not result.frames.flags.writeable
    assert len(result.frames_sha256) == 64 and len(result.latents_sha256) == 64
    assert result.latents.device.type == "cpu" and result.latents.shape == (1, 8, 3, 8, 12)
    assert set(result.timings) >= {"text_encode", "denoise", "decode", "total"}
    assert result.timings["total"] >= result.timings["denoise"] > 0
    assert result.attention_providers == {
        "transformer.self_attn": "sdpa:sdpa",
        "transformer.cross_attn": "sdpa:sdpa",
    }
    assert result.fingerprint["attention_providers"] == result.attention_providers
    assert result.fingerprint["dtype"] == "float32" and result.fingerprint["torch"] == torch.__version__
    assert result.args["negative_prompt"] == "blurry" and result.args["num_frames"] == 5
    # The pipeline drives denoise (one unit per step) and decode; a caller-owned reporter stays open.
    assert progress.events == [("denoise", 2), ("+", 1), ("+", 1), ("decode", 1), ("+", 1)]
    assert not progress.closed
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.frames_sha256 = "x"


def test_backends_agree(pipe):
    sdpa = pipe("a boat on a lake", seed=2, progress=False, attention_backend="sdpa", **SMALL)
    reference = pipe("a boat on a lake", seed=2, progress=False, attention_backend="flash:reference", **SMALL)
    assert reference.attention_providers["transformer.self_attn"] == "flash:reference"
    # Two attention kernels (torch's CPU flash kernel vs the pure-torch reference) sum the softmax and
    # P @ V in other orders: fp32 rounding that two guided steps of the trained model carry to 4.1e-5
    # and 4.4e-5 (AMD EPYC with AVX2 and AVX-512 kernels; latents up to ~3). 5e-4 leaves 10x room for
    # other CPUs; a wrong mask, scale or layout moves latents by O(0.1).
    assert (sdpa.latents - reference.latents).abs().max() < 5e-4


def test_prompt_enhancer_rewrites_first_and_both_are_recorded(pipe):
    enhanced = pipe("a fox", seed=3, progress=False, prompt_enhancer=lambda p: p + " in the snow", **SMALL)
    direct = pipe("a fox in the snow", seed=3, progress=False, **SMALL)
    assert enhanced.frames_sha256 == direct.frames_sha256
    assert enhanced.args["prompt"] == "a fox in the snow" and enhanced.args["prompt_original"] == "a fox"


def test_t2i_makes_one_frame(pipe):
    c = pipe.components
    t2i = WanT2IPipeline(c.transformer, c.text_encoder, c.tokenizer, c.vae, c.scheduler, defaults=c.defaults)
    image = t2i("a flower", seed=4, progress=False, height=32, width=32, num_inference_steps=2)
    video = pipe("a flower", seed=4, progress=False, height=32, width=32, num_frames=1, num_inference_steps=2)
    assert image.frames.shape == (1, 32, 32, 3) and image.image.shape == (32, 32, 3)
    assert image.frames_sha256 == video.frames_sha256
    assert image.args["pipeline"] == "WanT2IPipeline"
    with pytest.raises(ValidationError, match="num_frames"):
        t2i("a flower", num_frames=5)


def test_save_writes_png_or_mp4(pipe, tmp_path):
    import imageio.v3 as iio
    import imageio_ffmpeg

    result = pipe("a star", seed=0, progress=False, **SMALL)
    video = result.save(tmp_path / "v.mp4")
    assert imageio_ffmpeg.count_frames_and_secs(str(video))[0] == 5
    with pytest.raises(ValidationError, match="png"):
        result.save(tmp_path / "v.png")
    single = pipe("a star", seed=0, progress=False, **{**SMALL, "num_frames": 1})
    image = single.save(tmp_path / "i.png")
    assert np.array_equal(iio.imread(image), single.image)
