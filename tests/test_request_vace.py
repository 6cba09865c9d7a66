"""The request value's VACE fields (video, mask, reference_images, vace_scale) on every face: read, checked,
hashed and recorded once, model-independently; paths confined on the server, relative in a render file."""

from __future__ import annotations

import textwrap

import imageio
import numpy as np
import pytest
from PIL import Image

from mmgen.cli import build_parser, generate_request
from mmgen.errors import ValidationError
from mmgen.outputs.writers import frames_sha256
from mmgen.render.schema import load_render_file
from mmgen.serve.protocol import ApiError, Limits, video_submission
from pipelines.request import GenerationRequest
from pipelines.request_properties import field_role

FRAMES = np.random.default_rng(0).integers(0, 256, (5, 16, 32, 3), dtype=np.uint8)


def _folder(path, frames=FRAMES):
    path.mkdir()
    for index, frame in enumerate(frames):
        Image.fromarray(frame).save(path / f"{index:03d}.png")
    return path


def test_fields_are_job_fields_with_defaults():
    request = GenerationRequest.from_call(prompt="x")
    assert (request.video, request.mask, request.reference_images, request.vace_scale) == (
        None,
        None,
        (),
        1.0,
    )
    for name in ("video", "mask", "reference_images", "vace_scale"):
        assert field_role(name) == "job"
        assert GenerationRequest.model_fields[name].description


def test_folder_and_array_read_and_hash_alike(tmp_path):
    from_folder = GenerationRequest.from_call(prompt="x", video=_folder(tmp_path / "frames"))
    from_array = GenerationRequest.from_call(prompt="x", video=FRAMES)
    assert np.array_equal(from_folder.video.frames, FRAMES)
    assert from_folder.video.sha256 == from_array.video.sha256 == frames_sha256(FRAMES)
    assert (
        not from_array.video.frames.flags.writeable and FRAMES.flags.writeable
    )  # the caller's array untouched
    record = from_folder.record()
    assert record["video"] == str(tmp_path / "frames") and record["video_sha256"] == frames_sha256(FRAMES)


def test_video_file_and_grey_mask(tmp_path):
    path = tmp_path / "control.mp4"
    with imageio.get_writer(path, fps=8) as writer:
        for frame in FRAMES:
            writer.append_data(frame)
    grey = FRAMES[..., 0]
    request = GenerationRequest.from_call(prompt="x", video=str(path), mask=grey)
    assert request.video.frames.shape == (5, 16, 32, 3) and request.video.source == str(path)
    assert np.array_equal(request.mask.frames, np.repeat(grey[..., None], 3, axis=3))


def test_reference_images_one_or_several(tmp_path):
    path = tmp_path / "ref.png"
    Image.fromarray(FRAMES[0]).save(path)
    one = GenerationRequest.from_call(prompt="x", reference_images=str(path))
    several = GenerationRequest.from_call(prompt="x", reference_images=[path, FRAMES[1]])
    assert len(one.reference_images) == 1 and len(several.reference_images) == 2
    record = several.record()
    assert record["reference_images"] == [str(path), "array"]
    assert len(record["reference_images_sha256"]) == 2
    assert several.with_values(seed=3).reference_images == several.reference_images  # read once


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"video": "missing.mp4"}, "video: missing.mp4: file not found"),
        ({"mask": np.zeros((5, 16, 32, 4), np.uint8)}, "mask: an array must be uint8"),
        ({"video": np.zeros((5, 16, 32, 3), np.float32)}, "video: an array must be uint8"),
        ({"reference_images": ["nope.png"]}, "reference_images: nope.png: file not found"),
        ({"vace_scale": float("nan")}, "vace_scale = nan: must be a finite number"),
        ({"vace_scale": "1"}, "vace_scale = '1': must be a finite number"),
    ],
)
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(ValidationError, match=message):
        GenerationRequest.from_call(prompt="x", **fields)


def test_unreadable_file(tmp_path):
    path = tmp_path / "junk.mp4"
    path.write_bytes(b"not a video")
    with pytest.raises(ValidationError, match="video: .*junk.mp4: not a readable video or image"):
        GenerationRequest.from_call(prompt="x", video=str(path))


def test_cli_flags(tmp_path):
    folder = _folder(tmp_path / "frames")
    path = tmp_path / "ref.png"
    Image.fromarray(FRAMES[0]).save(path)
    args = ["generate", "x", "--video", str(folder), "--mask", str(folder)]
    args += ["--reference-image", str(path), "--reference-image", str(path), "--vace-scale", "0.5"]
    request = generate_request(build_parser().parse_args(args))
    assert request.video.sha256 == request.mask.sha256 == frames_sha256(FRAMES)
    assert len(request.reference_images) == 2 and request.vace_scale == 0.5


def test_render_paths_are_relative_to_the_file(tmp_path):
    _folder(tmp_path / "frames")
    Image.fromarray(FRAMES[0]).save(tmp_path / "ref.png")
    source = tmp_path / "render.yaml"
    source.write_text(
        textwrap.dedent(
            """
            defaults: {vace_scale: 0.8}
            jobs:
              - {prompt: a, video: frames, mask: frames, reference_images: [ref.png]}
            """
        )
    )
    job = load_render_file(source).jobs[0]
    assert job.request.video.source == str(tmp_path / "frames")
    assert job.request.reference_images[0].source == str(tmp_path / "ref.png")
    assert job.request.vace_scale == 0.8


def test_server_confines_paths(tmp_path):
    inputs = tmp_path / "inputs"
    _folder(inputs)
    Image.fromarray(FRAMES[0]).save(inputs / "ref.png")
    limits = Limits(model="m", height=16, width=32, num_frames=5, fps=8, input_dir=inputs)
    body = {"prompt": "a", "video": "000.png", "reference_images": ["ref.png"]}
    submission = video_submission(body, limits)
    assert submission is not None
    for field, value in (
        ("video", "../inputs/../x.mp4"),
        ("mask", "/etc/passwd"),
        ("reference_images", ["../ref.png"]),
    ):
        with pytest.raises(ApiError, match=f"{field} = .*not inside the server's --input-dir"):
            video_submission({"prompt": "a", field: value}, limits)
    with pytest.raises(ApiError, match="mask: this server takes no paths for mask"):
        video_submission(
            {"prompt": "a", "mask": "m.png"}, Limits(model="m", height=16, width=32, num_frames=5, fps=8)
        )


def test_vace_scale_is_one_number_or_one_per_block(tmp_path):
    # the model takes one scale per VACE block: a list is kept as given (its count is the model's check)
    request = GenerationRequest.from_call(prompt="x", vace_scale=[1, 0.5, 0.25])
    assert request.vace_scale == (1.0, 0.5, 0.25) and request.record()["vace_scale"] == (1.0, 0.5, 0.25)
    assert GenerationRequest.from_call(**request.record()) == request
    for bad in ([], [1.0, float("inf")], [True]):
        with pytest.raises(
            ValidationError, match="vace_scale = .*: must be a finite number, or a list of them"
        ):
            GenerationRequest.from_call(prompt="x", vace_scale=bad)
    # the command line: comma-separated; one number stays a number
    parse = build_parser().parse_args
    assert generate_request(parse(["generate", "x", "--vace-scale", "1,0.5"])).vace_scale == (1.0, 0.5)
    assert generate_request(parse(["generate", "x", "--vace-scale", "0.5"])).vace_scale == 0.5
    # a render file: a YAML list
    config = tmp_path / "vace.yaml"
    config.write_text("model: default\njobs:\n  - {prompt: x, vace_scale: [0.5, 0.75]}\n")
    assert load_render_file(config).jobs[0].request.vace_scale == (0.5, 0.75)
