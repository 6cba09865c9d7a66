"""Qwen-Image-2.1 through the faces (pipelines.qwen_image21_family): its refusals, `mmgen generate`,
render YAML and `mmgen ab` on tiny random directories (CPU, fp32). The pipeline itself is checked
against diffusers in test_qwen_image21_pipeline; here each face's output is the Python call's.
"""

from __future__ import annotations

import numpy as np
import pytest
from qwen_image21_pipeline_cases import family_pipeline, tiny_parts

from mmgen.errors import ValidationError
from pipelines.qwen_image21_family import QwenImage21FamilyPipeline

pytest.importorskip("diffusers")
STEPS = 3


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    return family_pipeline(tiny_parts(tmp_path_factory.mktemp("q21f")), 64)


def test_refusals_name_the_field(pipe):
    with pytest.raises(ValidationError, match="height = 80"):
        pipe("x", height=80, width=64, num_inference_steps=1, progress=False)
    with pytest.raises(
        ValidationError, match=r"width = 112: must be a positive multiple of 32 \(nearest: 96 or 128\)"
    ):
        pipe("x", height=64, width=112, num_inference_steps=1, progress=False)
    with pytest.raises(ValidationError, match="num_frames"):
        pipe("x", num_frames=5, progress=False)


def pipe_request(prompt, **fields):
    from pipelines.request import GenerationRequest

    return GenerationRequest.from_call(prompt=prompt, **fields)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from qwen_image21_pipeline_cases import write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21dir")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


def test_mmgen_generate_writes_the_rgba_png(model_dir, tmp_path, capsys):
    """A Qwen-Image-2.1 directory is detected by model_index.json (_class_name QwenImage21Pipeline) and
    `mmgen generate` writes its RGBA image; the PNG holds the in-process pipeline's pixels exactly."""
    from PIL import Image

    from mmgen.cli import main
    from mmgen.families import family_of

    directory = model_dir
    assert family_of(directory).name == "qwen-image-2.1"
    out = tmp_path / "kite.png"
    argv = ["generate", "--model", str(directory), "--out", str(out), "--steps", "2", "--height", "64"]
    argv += ["--width", "96", "--seed", "5", "--device", "cpu", "--dtype", "fp32", "a kite"]
    assert main(argv) == 0
    pipe = QwenImage21FamilyPipeline.from_pretrained(directory, dtype="float32")
    result = pipe("a kite", seed=5, height=64, width=96, num_inference_steps=2, progress=False)
    assert f"frames_sha256: {result.frames_sha256}" in capsys.readouterr().out
    with Image.open(out) as written:
        assert written.mode == "RGBA"
        np.testing.assert_array_equal(np.asarray(written), result.frames[0])


def test_render_yaml_job_equals_the_python_call(model_dir, tmp_path):
    """`mmgen render` over a Qwen-Image-2.1 directory (task t2i): the manifest identity is the call's."""
    import json

    from PIL import Image

    from mmgen.cli import main

    config = tmp_path / "render.yaml"
    config.write_text(
        f"model: {model_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {height: 64, width: 64, num_frames: 1, num_inference_steps: 2}\n"
        "jobs:\n  - {name: dog, prompt: a dog, negative_prompt: dark, guidance_scale: 3.0, seed: 4}\n"
    )
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32")
    common = {"seed": 4, "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 3.0}
    result = pipe("a dog", "dark", **common, progress=False)
    assert record["status"] == "ok", record
    assert record["frames_sha256"] == result.frames_sha256
    with Image.open(tmp_path / "out" / "dog_s4.png") as written:
        np.testing.assert_array_equal(np.asarray(written), result.frames[0])


@pytest.fixture(scope="module")
def condition_pngs(tmp_path_factory):
    """Two condition images beside a render file: an RGB 60 x 40 PNG and an RGBA 40 x 56 PNG."""
    from PIL import Image

    folder, state = tmp_path_factory.mktemp("inputs"), np.random.RandomState(5)
    Image.fromarray((state.rand(40, 60, 3) * 255).astype(np.uint8)).save(folder / "first.png")
    Image.fromarray((state.rand(56, 40, 4) * 255).astype(np.uint8), mode="RGBA").save(folder / "second.png")
    return folder / "first.png", folder / "second.png"


def _edit_render(model_dir, folder, name="edit.yaml"):
    """A render file beside the condition images: one edit job naming both by relative path."""
    config = folder / name
    config.write_text(
        f"model: {model_dir}\ntask: t2i\ndevice: cpu\ndtype: float32\n"
        "defaults: {num_inference_steps: 2, output_resolution: 64}\n"
        "jobs:\n  - {name: mix, prompt: mix them, seed: 3, image: [first.png, second.png]}\n"
    )
    return config


def test_render_yaml_with_condition_images(model_dir, condition_pngs, tmp_path):
    """A render job's `image` list (paths relative to the file, the second RGBA): the manifest records
    both images by path and sha256, and its frames are the Python call's with the same files."""
    import json

    from mmgen.cli import main

    config = _edit_render(model_dir, condition_pngs[0].parent)
    assert main(["render", str(config), "--out", str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "manifest.jsonl").read_text().splitlines()[0])
    pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32")
    paths = [str(path) for path in condition_pngs]
    result = pipe(
        "mix them", image=paths, output_resolution=64, seed=3, num_inference_steps=2, progress=False
    )
    assert record["status"] == "ok", record
    assert record["frames_sha256"] == result.frames_sha256
    assert record["args"]["image"] == paths and len(record["args"]["image_sha256"]) == 2
    assert result.args["variant"] == "edit"


def test_mmgen_generate_takes_several_images(model_dir, condition_pngs, tmp_path, capsys):
    """`mmgen generate --image A --image B`: the Python call's image, both images' sha256 printed."""
    from mmgen.cli import main

    out = tmp_path / "mix.png"
    argv = ["generate", "mix them", "--model", str(model_dir), "--out", str(out), "--steps", "2"]
    argv += ["--seed", "3", "--device", "cpu", "--output-resolution", "64", "--no-progress"]
    argv += ["--image", str(condition_pngs[0]), "--image", str(condition_pngs[1])]
    assert main(argv) == 0
    pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32")
    paths = [str(path) for path in condition_pngs]
    result = pipe(
        "mix them", image=paths, output_resolution=64, seed=3, num_inference_steps=2, progress=False
    )
    printed = capsys.readouterr().out
    assert f"frames_sha256: {result.frames_sha256}" in printed
    assert f"image_sha256: {' '.join(result.args['image_sha256'])}" in printed


def test_ab_prefix_cache_off_against_on(model_dir, condition_pngs, tmp_path):
    """`mmgen ab` on a 2.1 edit render: the candidate turns the cached prefix off (the declared
    variable); the same image up to rounding (fp32 latents within 1e-6 of each other: equal frames,
    or a value off by one level on a rounding point, far above 40 dB)."""
    import json

    from mmgen.cli import main
    from mmgen.render.ab import REPORT_NAME

    config = _edit_render(model_dir, condition_pngs[0].parent, "ab.yaml")
    argv = ["ab", str(config), "--set", "no_prefix_cache=true", "--out", str(tmp_path / "ab")]
    assert main([*argv, "--expect", "psnr>=40", "--no-progress"]) == 0
    report = json.loads((tmp_path / "ab" / REPORT_NAME).read_text())
    assert report["declared"] == ["no_prefix_cache"] and not report["refused"]
    (row,) = report["jobs"]
    assert row["verdict"] == "ok" and (row["sha_equal"] or row["max_abs"] <= 1)
    pipe = QwenImage21FamilyPipeline.from_pretrained(model_dir, dtype="float32")
    paths = [str(path) for path in condition_pngs]
    result = pipe(
        "mix them", image=paths, output_resolution=64, seed=3, num_inference_steps=2, progress=False
    )
    assert row["base_frames_sha256"] == result.frames_sha256
