"""Wan2.1 VACE through the one Wan pipeline vs diffusers' WanVACEPipeline (CPU, fp32, tiny random transformer).

The model directory is the embedded default model's (text encoder, tokenizer, VAE, scheduler) with
its transformer replaced by a tiny random diffusers WanVACETransformer3DModel and model_index.json
naming WanVACEPipeline: mmgen loads it with its own loaders (the variant detected from the
transformer config's vace_layers), diffusers from the same files. Inputs are files (a folder of PNG
frames, PNG reference images whose sides are not multiples of 8) and a uint8 array, at a
non-square size; both pipelines get the same noise.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from vace_cases import picture, write_vace_dir

from mmgen.errors import ValidationError
from mmgen.models.wan_vace import WanVACEDiT
from pipelines.request import GenerationRequest
from pipelines.wan_t2v import WanT2VPipeline

PROMPT = "a red fox running through a snowy forest at sunset"
NEGATIVE = "blurry dark"
HEIGHT, WIDTH, FRAMES = 32, 48, 5  # non-square; the default VAE (x4 spatial, x2 temporal): 3 latent frames
TOLERANCE = 1e-5  # max abs difference of fp32 final latents


@pytest.fixture(autouse=True)
def _no_ftfy_in_reference(monkeypatch):
    # diffusers' WanVACEPipeline calls ftfy unconditionally; without it installed, the identity.
    import types

    from diffusers.pipelines.wan import pipeline_wan_vace

    if not hasattr(pipeline_wan_vace, "ftfy"):
        monkeypatch.setattr(pipeline_wan_vace, "ftfy", types.SimpleNamespace(fix_text=str), raising=False)


@pytest.fixture(scope="module")
def vace_dir(default_model_dir, tmp_path_factory):
    return write_vace_dir(default_model_dir, tmp_path_factory.mktemp("vace") / "model")


@pytest.fixture(scope="module")
def ours(vace_dir):
    return WanT2VPipeline.from_pretrained(vace_dir)


@pytest.fixture(scope="module")
def reference(vace_dir):
    from diffusers import WanVACEPipeline

    pipe = WanVACEPipeline.from_pretrained(vace_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _frames_dir(path, frames):
    path.mkdir()
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(path / f"{index:03d}.png")
    return path


def _noise(pipe, references, seed=7):
    shape = pipe.latents_shape(HEIGHT, WIDTH, FRAMES, references)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _compare(ours, reference, noise, ours_inputs, reference_inputs, references, **settings):
    kwargs = dict(height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=3, **settings)
    result = ours(PROMPT, NEGATIVE, latents=noise, progress=False, **ours_inputs, **kwargs)
    ref_kwargs = {**kwargs, **reference_inputs}
    if "vace_scale" in ref_kwargs:
        ref_kwargs["conditioning_scale"] = ref_kwargs.pop("vace_scale")
    expected = reference(
        prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), output_type="latent", **ref_kwargs
    ).frames
    assert expected.shape == noise.shape  # the reference frames lead the latents
    expected = expected[:, :, references:]  # diffusers drops the reference frames only before decoding
    assert result.latents.shape == expected.shape
    diff = (result.latents - expected).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff of final latents {diff:.3g}"
    assert expected.abs().max() > 0.5
    frames = reference(
        prompt=PROMPT, negative_prompt=NEGATIVE, latents=noise.clone(), output_type="np", **ref_kwargs
    ).frames[0]
    expected_frames = np.stack(
        [np.asarray(Image.fromarray((f * 255).round().astype(np.uint8))) for f in frames]
    )
    np.testing.assert_array_equal(ours.decode(expected), expected_frames)  # same latents: identical uint8
    np.testing.assert_array_equal(result.frames, expected_frames)
    return result, diff


def test_loads_as_vace_variant(ours):
    assert isinstance(ours.transformer, WanVACEDiT)
    assert ours.variant.control and ours.variant.task == "vace"


@pytest.mark.parametrize("guidance", [5.0, 1.0])
def test_reference_to_video_matches_diffusers(ours, reference, tmp_path, guidance):
    # sides not multiples of 8: resized first. In time the first reference leads (main's numbers: the
    # 45 x 21 picture first, 37 x 50 second, as before the order changed)
    pictures = [picture(45, 21, 2), picture(37, 50, 1)]
    paths = []
    for index, pixels in enumerate(pictures):
        paths.append(tmp_path / f"reference{index}.png")
        Image.fromarray(pixels).save(paths[-1])
    result, _ = _compare(
        ours,
        reference,
        _noise(ours, 2),
        {"reference_images": paths},
        # diffusers puts the last reference first, mmgen the first (the original VACE code's order):
        # the same frames for the list reversed
        {"reference_images": [Image.open(p).convert("RGB") for p in paths[::-1]]},
        2,
        guidance_scale=guidance,
    )
    assert result.args["variant"] == "vace"
    assert result.args["reference_images"] == [str(p) for p in paths]
    assert len(result.args["reference_images_sha256"]) == 2


def test_masked_video_to_video_matches_diffusers(ours, reference, tmp_path):
    video = np.stack([picture(HEIGHT, WIDTH, 10 + i) for i in range(FRAMES)])
    mask = np.zeros((FRAMES, HEIGHT, WIDTH), np.uint8)
    mask[:, 8:24, 12:40] = 255  # regenerate a box, keep the rest
    mask[3:, :, :6] = 128  # grey: above 0.5 once mapped to [0, 1]
    folder = _frames_dir(tmp_path / "video", video)
    mask_rgb = np.repeat(mask[..., None], 3, axis=3)
    result, _ = _compare(
        ours,
        reference,
        _noise(ours, 0),
        {"video": folder, "mask": mask, "vace_scale": 0.75},
        {
            "video": [Image.fromarray(f) for f in video],
            "mask": [Image.fromarray(f) for f in mask_rgb],
            "vace_scale": 0.75,
        },
        0,
        guidance_scale=4.0,
    )
    assert result.args["video"] == str(folder) and result.args["mask"] == "array"
    assert result.args["vace_scale"] == 0.75


def test_outpainting_matches_diffusers(ours, reference):
    # the picture in the middle, a border to generate (black in the video, white in the mask)
    video = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    mask = np.full((FRAMES, HEIGHT, WIDTH, 3), 255, np.uint8)
    video[:, 8:24, 8:40] = picture(16, 32, 4)
    mask[:, 8:24, 8:40] = 0
    _compare(
        ours,
        reference,
        _noise(ours, 0, seed=9),
        {"video": video, "mask": mask},
        {"video": [Image.fromarray(f) for f in video], "mask": [Image.fromarray(f) for f in mask]},
        0,
        guidance_scale=5.0,
    )


def test_vace_inputs_are_checked_against_the_request(ours, tmp_path):
    video = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    with pytest.raises(ValidationError, match="video: 5 frames of 48x32, but the request is 9 frames"):
        ours(PROMPT, video=video, num_frames=9, num_inference_steps=1, progress=False)
    with pytest.raises(
        ValidationError, match="mask: 5 frames of 48x32, but the request is 5 frames of 64x32"
    ):
        ours(PROMPT, mask=video, width=64, height=32, num_inference_steps=1, progress=False)
    with pytest.raises(ValidationError, match="Wan VACE: the step cache is not supported"):
        ours(PROMPT, video=video, step_cache=0.1, num_inference_steps=1, progress=False)
    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")
    with pytest.raises(ValidationError, match="Wan VACE: LoRAs are not supported"):
        ours(PROMPT, lora=str(lora), num_inference_steps=1, progress=False)
    with pytest.raises(ValidationError, match="Wan VACE: offload = 'layer' is not supported"):
        ours(PROMPT, offload="layer", num_inference_steps=1, progress=False)


def test_size_and_frames_come_from_the_video(ours):
    video = np.stack([picture(HEIGHT, WIDTH, i) for i in range(FRAMES)])
    result = ours(PROMPT, video=video, num_inference_steps=1, guidance_scale=1.0, progress=False)
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert "video" in result.args["size_rule"]


def test_vace_fields_need_a_vace_checkpoint(default_model_dir):
    plain = WanT2VPipeline.from_pretrained(default_model_dir)
    with pytest.raises(ValidationError, match="reference_images: need a Wan VACE checkpoint"):
        plain(PROMPT, reference_images=np.zeros((16, 16, 3), np.uint8), progress=False)


def vace_latents(layout, model_dir, video, mask, reference):
    """Final latents of a guided masked V2V + reference generation (layout None = one process)."""
    pipe = WanT2VPipeline.from_pretrained(model_dir, parallel=layout)
    result = pipe(
        PROMPT,
        NEGATIVE,
        video=video,
        mask=mask,
        reference_images=[reference],
        num_inference_steps=2,
        guidance_scale=5.0,
        seed=3,
        progress=False,
    )
    return result.latents


@pytest.mark.parametrize("config", ["sp2", "ring2", "cfg"])
def test_gloo_world_matches_one_process(vace_dir, config):
    import parallel_workers

    from mmgen.parallel.layout import ParallelConfig

    parallel = {
        "sp2": ParallelConfig(sp=2),
        "ring2": ParallelConfig(sp=2, ring=2),
        "cfg": ParallelConfig(cfg=True),
    }
    video = np.stack([picture(HEIGHT, WIDTH, 20 + i) for i in range(FRAMES)])
    mask = np.zeros((FRAMES, HEIGHT, WIDTH), np.uint8)
    mask[:, 4:28, 8:40] = 255
    inputs = (vace_dir, video, mask, picture(40, 24, 5))
    single = vace_latents(None, *inputs)
    # The control tokens are sharded like the main stream's (Ulysses / ring) or each rank runs one
    # CFG branch; only GEMM shapes and the blockwise softmax differ from one process.
    latents = parallel_workers.run_forked(vace_latents, parallel[config], *inputs)
    diff = (latents - single).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff:.3g}"


def test_mmgen_generate_with_vace_flags(vace_dir, tmp_path, capsys):
    from mmgen.cli import main

    folder = _frames_dir(tmp_path / "video", np.stack([picture(HEIGHT, WIDTH, i) for i in range(FRAMES)]))
    reference = tmp_path / "ref.png"
    Image.fromarray(picture(30, 20, 6)).save(reference)
    out = tmp_path / "out.mp4"
    args = ["generate", PROMPT, "--model", str(vace_dir), "--video", str(folder), "--mask", str(folder)]
    args += ["--reference-image", str(reference), "--vace-scale", "0.5", "--steps", "1", "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0, capsys.readouterr().err
    assert out.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "video_sha256: " in printed and "reference_images_sha256: " in printed
    assert main([*args, "--frames", "9", "--out", str(out)]) == 2
    assert "video: 5 frames of 48x32, but the request is 9 frames of 48x32" in capsys.readouterr().err


def test_a_scale_per_vace_block_matches_diffusers(ours, reference):
    """vace_scale as a list: one scale per VACE block, in block order (diffusers' conditioning_scale list)."""
    blocks = len(ours.transformer.config.vace_layers)
    scales = [0.3 + 0.9 * index for index in range(blocks)]  # unequal: a wrong pairing shows
    video = np.stack([picture(HEIGHT, WIDTH, 30 + i) for i in range(FRAMES)])
    mask = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    mask[:, 8:24, 12:40] = 255
    result, _ = _compare(
        ours,
        reference,
        _noise(ours, 0, seed=11),
        {"video": video, "mask": mask, "vace_scale": scales},
        {
            "video": [Image.fromarray(f) for f in video],
            "mask": [Image.fromarray(f) for f in mask],
            "vace_scale": scales,
        },
        0,
        guidance_scale=4.0,
    )
    assert blocks >= 2 and result.args["vace_scale"] == tuple(scales)


def test_a_wrong_count_of_vace_scales_is_one_line_before_any_work(vace_dir, ours, tmp_path):
    blocks = len(ours.transformer.config.vace_layers)
    message = (
        f"vace_scale: {blocks + 1} numbers given, but this model has {blocks} VACE blocks; give one "
        f"number (every block) or {blocks} (one per block, in block order)"
    )
    with pytest.raises(ValidationError) as caught:
        ours.check_request(
            GenerationRequest.from_call(
                prompt=PROMPT, video=np.zeros((5, 32, 48, 3), np.uint8), vace_scale=[1.0] * (blocks + 1)
            )
        )
    assert str(caught.value) == message
    # through the command: the comma-separated flag, one error line
    scales = ",".join(["0.5"] * (blocks + 1))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmgen.cli",
            "generate",
            PROMPT,
            "--model",
            str(vace_dir),
            "--vace-scale",
            scales,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and done.stderr == f"mmgen: error: {message}\n", done.stderr
