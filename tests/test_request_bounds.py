"""Every request value that could exhaust memory or time is bounded, on the value and on the command line.

The bounds (pipelines.request / pipelines.checks): steps, text tokens, prompt characters, seeds, the
pixels of a frame and of a request (frames x height x width); a blank prompt is refused like an empty one. `mmgen generate` refuses each in one line, before any
model loads (a fresh cache directory stays empty: the default model is never built).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

from mmgen.errors import ValidationError
from pipelines.checks import (
    MAX_FRAME_PIXELS,
    MAX_LORAS,
    MAX_PIXELS,
    MAX_REFERENCE_IMAGES,
    MAX_SEED,
    MAX_STEPS,
    PIXELS_HELP,
)
from pipelines.image_input import MAX_IMAGE_SIDE
from pipelines.request import GenerationRequest
from pipelines.request_fields import MAX_PROMPT_CHARS, MAX_TEXT_LEN

PROMPT = "a red circle moves right on a black background"


@pytest.mark.parametrize(
    ("name", "largest", "message"),
    [
        ("num_inference_steps", 1000, "num_inference_steps = 1001: must be an integer in [1, 1000]"),
        ("max_sequence_length", 1024, "max_sequence_length = 1025: must be an integer in [2, 1024]"),
        ("seed", 2**63 - 1, "seed = 9223372036854775808: must be an integer in [0, 2**63 - 1]"),
    ],
)
def test_numbers_have_a_largest_value(name, largest, message):
    assert GenerationRequest.from_call(prompt=PROMPT, **{name: largest}).model_dump()[name] == largest
    with pytest.raises(ValidationError) as err:
        GenerationRequest.from_call(prompt=PROMPT, **{name: largest + 1})
    assert message in str(err.value)
    assert (MAX_STEPS, MAX_TEXT_LEN, MAX_SEED) == (1000, 1024, 2**63 - 1)


@pytest.mark.parametrize("name", ["prompt", "negative_prompt"])
def test_prompts_have_a_length_bound_in_characters(name):
    fields = {"prompt": PROMPT}
    assert GenerationRequest.from_call(**{**fields, name: "a" * MAX_PROMPT_CHARS})
    with pytest.raises(ValidationError) as err:
        GenerationRequest.from_call(**{**fields, name: "a" * (MAX_PROMPT_CHARS + 1)})
    assert f"{name}: {MAX_PROMPT_CHARS + 1} characters; at most {MAX_PROMPT_CHARS}" in str(err.value)


def test_a_blank_prompt_is_refused_like_an_empty_one():
    for blank in (" ", "\n\t  "):
        with pytest.raises(ValidationError) as err:
            GenerationRequest.from_call(prompt=blank)
        assert "prompt: must not be blank" in str(err.value)
    # a blank negative prompt is a choice (Qwen-Image's README command passes " ")
    assert GenerationRequest.from_call(prompt=PROMPT, negative_prompt=" ").negative_prompt == " "


def test_the_seed_range_is_the_range_of_distinct_noise():
    # torch's CPU generator makes the same noise for s and s + 2**63: the range stops below 2**63.
    def noise(seed: int) -> torch.Tensor:
        return torch.randn(8, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(noise(5), noise(5 + 2**63))
    assert not torch.equal(noise(MAX_SEED), noise(MAX_SEED - 1))
    assert MAX_SEED + 1 == 2**63
    help_text = GenerationRequest.model_fields["seed"].description
    assert f"[0, {MAX_SEED}]" in help_text and "2**63 - 1" in help_text


def test_the_server_draws_its_random_seeds_from_the_range():
    from mmgen.serve.protocol import Limits, checked_request

    limits = Limits(model="m", height=48, width=48, num_frames=9, fps=16)
    seeds = [checked_request({"prompt": PROMPT}, limits).seed for _ in range(64)]
    assert all(0 <= seed <= MAX_SEED for seed in seeds), max(seeds)


def test_sizes_times_frames_are_bounded():
    # the largest outputs of the supported families fit: Wan 720p at 81 frames, TI2V-5B's 1280x704 at
    # 121, Qwen-Image-2.1's 1536x1536 image
    for height, width, frames in [(720, 1280, 81), (704, 1280, 121), (1536, 1536, 1), (720, 1280, 129)]:
        GenerationRequest.from_call(prompt=PROMPT, height=height, width=width, num_frames=frames)
    GenerationRequest.from_call(prompt=PROMPT, height=2048, width=2048)  # frames: the model's default
    for fields, message in [
        (
            {"height": 2064, "width": 2048},
            "height x width = 2064 x 2048 = 4227072 pixels: at most 4194304 (2048 x 2048) per frame",
        ),
        (
            {"height": 8192, "width": 8192, "num_frames": 1},
            "height x width = 8192 x 8192 = 67108864 pixels: at most 4194304",
        ),
        (
            {"height": 720, "width": 1280, "num_frames": 133},
            "num_frames x height x width = 133 x 720 x 1280 = 122572800 pixels: at most 118886400",
        ),
    ]:
        with pytest.raises(ValidationError) as err:
            GenerationRequest.from_call(prompt=PROMPT, **fields)
        assert message in str(err.value)
    # a request prepared with the model's defaults is checked again (pipelines fill them in this way)
    with pytest.raises(ValidationError, match="num_frames x height x width = 100001 x 48 x 48"):
        GenerationRequest.from_call(prompt=PROMPT, num_frames=100001).with_values(height=48, width=48)
    assert (MAX_FRAME_PIXELS, MAX_PIXELS) == (2048 * 2048, 129 * 1280 * 720)
    for name in ("height", "width", "num_frames"):
        assert PIXELS_HELP in GenerationRequest.model_fields[name].description


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header states width x height and that holds no pixel data (a decompression bomb's
    header: what PIL reads when it opens a file)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("width", "height", "stated"),
    [(10000, 10000, "10000x10000"), (15000, 15000, "over 178956970")],  # PIL: warns, refuses
)
@pytest.mark.parametrize("name", ["image", "reference_images"])
def test_an_input_image_is_bounded_from_its_header(tmp_path, recwarn, width, height, stated, name):
    path = tmp_path / "bomb.png"
    path.write_bytes(png_claiming(width, height))
    with pytest.raises(ValidationError) as err:
        GenerationRequest.from_call(prompt=PROMPT, **{name: str(path) if name == "image" else [str(path)]})
    assert f"{path}: {stated} pixels; an input image is at most {MAX_IMAGE_SIDE} pixels a side" in str(
        err.value
    )
    assert not recwarn.list  # PIL's DecompressionBombWarning is not shown: the error says it in one line


def test_an_input_video_decodes_at_most_the_request_bound(tmp_path, monkeypatch):
    # a small file can hold many frames: without a server's --max-pixels, the bound is MAX_PIXELS
    import numpy as np
    from PIL import Image

    import pipelines.video_input

    frames = tmp_path / "frames"
    frames.mkdir()
    for index in range(3):
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(frames / f"{index}.png")
    assert GenerationRequest.from_call(prompt=PROMPT, video=str(frames)).video.frames.shape[0] == 3
    monkeypatch.setattr(pipelines.video_input, "MAX_PIXELS", 2 * 16 * 16)
    with pytest.raises(ValidationError, match="video: decodes to more than 512 pixels"):
        GenerationRequest.from_call(prompt=PROMPT, video=str(frames))


def test_reference_images_are_counted_before_any_is_read(tmp_path):
    from PIL import Image

    path = tmp_path / "ref.png"
    Image.new("RGB", (16, 16)).save(path)
    assert (
        len(GenerationRequest.from_call(prompt=PROMPT, reference_images=[str(path)] * 8).reference_images)
        == 8
    )
    missing = [str(tmp_path / f"{index}.png") for index in range(MAX_REFERENCE_IMAGES + 1)]  # none exists
    with pytest.raises(ValidationError, match=r"reference_images: 9 images; at most 8$"):
        GenerationRequest.from_call(prompt=PROMPT, reference_images=missing)
    assert "at most 8" in GenerationRequest.model_fields["reference_images"].description


def test_loras_are_counted_before_any_is_read(tmp_path):
    missing = [str(tmp_path / f"{index}.safetensors") for index in range(MAX_LORAS + 1)]  # none exists
    with pytest.raises(ValidationError, match=r"lora: 17 LoRAs; at most 16$"):
        GenerationRequest.from_call(prompt=PROMPT, lora=missing)
    with pytest.raises(ValidationError, match="file\\(s\\) not found"):  # 16: then each file is looked for
        GenerationRequest.from_call(prompt=PROMPT, lora=missing[:MAX_LORAS])
    assert f"at most {MAX_LORAS}" in GenerationRequest.model_fields["lora"].description


def test_the_bounds_are_in_the_help():
    fields = GenerationRequest.model_fields
    assert f"1 to {MAX_STEPS}" in fields["num_inference_steps"].description
    assert f"2 to {MAX_TEXT_LEN}" in fields["max_sequence_length"].description
    assert f"at most {MAX_PROMPT_CHARS} characters" in fields["prompt"].description


def run_generate(*args: str, cache: Path, cwd: Path) -> tuple[int, str, str, float]:
    """`mmgen generate ARGS` as a user runs it; (exit code, stdout, stderr, seconds)."""
    script = shutil.which("mmgen")
    command = [script] if script else [sys.executable, "-m", "mmgen.cli"]
    env = {**os.environ, "MMGEN_CACHE_DIR": str(cache)}
    tick = time.monotonic()
    done = subprocess.run(
        [*command, "generate", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - tick


def test_a_billion_steps_is_one_line_within_ten_seconds(tmp_path):
    cache = tmp_path / "cache"
    code, stdout, stderr, seconds = run_generate("a cat", "--steps", "1000000000", cache=cache, cwd=tmp_path)
    assert code == 2 and stdout == "", stderr
    assert stderr == (
        "mmgen: error: --steps: num_inference_steps = 1000000000: must be an integer in [1, 1000]\n"
    )
    assert seconds < 10, seconds
    assert not cache.exists() or not any(cache.iterdir())  # no model was built


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--height", "47"], "--height: height = 47: must be a positive multiple of 16"),
        (["--width", "8208"], "--width: width = 8208: must be at most 8192 pixels"),
        (["--frames", "10"], "--frames: num_frames = 10: must be 4k+1"),
        (["--max-sequence-length", "1000000"], "--max-sequence-length: max_sequence_length = 1000000"),
        (["--seed", str(2**63)], "--seed: seed = 9223372036854775808: must be an integer in [0, 2**63 - 1]"),
        (["--height", "2064", "--width", "2048"], "--height: height x width = 2064 x 2048 = 4227072 pixels"),
        (
            ["--frames", "133", "--height", "720", "--width", "1280"],
            "--frames: num_frames x height x width = 133 x 720 x 1280 = 122572800 pixels: at most 118886400",
        ),
    ],
)
def test_generate_refuses_a_bad_value_before_loading_the_model(tmp_path, args, message):
    # --model names a directory that holds no model: loading it would fail with another message, and
    # the default model (without --model) would be built into the empty cache directory.
    cache, empty = tmp_path / "cache", tmp_path / "not-a-model"
    empty.mkdir()
    for model in (["--model", str(empty)], []):
        code, stdout, stderr, _ = run_generate("a cat", *model, *args, cache=cache, cwd=tmp_path)
        lines = stderr.splitlines()
        assert code == 2 and stdout == "" and len(lines) == 1, stderr
        assert lines[0].startswith(f"mmgen: error: {message}"), lines[0]
        assert not cache.exists() or not any(cache.iterdir())
    assert not list(tmp_path.glob("*.mp4"))


def test_frames_past_the_bound_at_the_models_size_are_one_line(tmp_path, default_model_dir):
    # the size comes from the model's defaults: refused when the pipeline fills them in, before any step
    model = ["--model", str(default_model_dir)]
    code, stdout, stderr, _ = run_generate(
        "a cat", *model, "--frames", "100001", cache=tmp_path, cwd=tmp_path
    )
    assert code == 2 and stdout == "", stderr
    assert (
        stderr.startswith("mmgen: error: num_frames x height x width = 100001 x ") and stderr.count("\n") == 1
    )
    assert f"at most {MAX_PIXELS}" in stderr
    assert not list(tmp_path.glob("*.mp4"))


def test_serve_takes_no_max_pixels_above_the_request_bound(tmp_path):
    pytest.importorskip("fastapi")
    script = shutil.which("mmgen")
    command = [script] if script else [sys.executable, "-m", "mmgen.cli"]
    done = subprocess.run(
        [*command, "serve", "--max-pixels", str(MAX_PIXELS + 1), "--state", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == (
        f"mmgen: error: --max-pixels = {MAX_PIXELS + 1}: must be in [1, {MAX_PIXELS}] (no request may ask "
        "for more)\n"
    )


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (" \t ", "prompt: must not be blank (it is whitespace only)"),
        (
            "a" * (MAX_PROMPT_CHARS + 1),
            f"prompt: {MAX_PROMPT_CHARS + 1} characters; at most {MAX_PROMPT_CHARS}",
        ),
    ],
    ids=["blank", "long"],
)
def test_generate_refuses_a_blank_or_long_prompt_in_one_line(tmp_path, prompt, message):
    code, stdout, stderr, _ = run_generate(prompt, cache=tmp_path / "cache", cwd=tmp_path)
    assert (code, stdout) == (2, "") and stderr.startswith(f"mmgen: error: {message}"), stderr
    assert stderr.count("\n") == 1 and not (tmp_path / "cache").exists()
