"""The image faces: `mmgen generate --image`, `task: i2v` and per-job `image:` in render YAML (no model loads)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from PIL import Image

import mmgen.families
from mmgen.cli import main as mmgen_main
from mmgen.render.schema import RenderConfigError, load_render_file
from pipelines.image_input import read_image


def _picture(path, value=0, size=(20, 12)):
    Image.fromarray(np.full((size[1], size[0], 3), value, np.uint8)).save(path)
    return path


def test_generate_checks_the_image_before_loading(tmp_path, monkeypatch, capsys):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded for a missing image")

    monkeypatch.setattr(mmgen.families, "load_pipeline", no_model)
    (tmp_path / "junk.webp").write_bytes(b"RIFF0000WEBPjunk")
    for name, reason in (("missing.png", "file not found"), ("junk.webp", "not a readable image")):
        code = mmgen_main(["generate", "a cat", "--image", str(tmp_path / name), "--device", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1, err
        assert err[0].startswith("mmgen: error: --image: ") and reason in err[0] and name in err[0]


def test_generate_with_an_image_on_a_text_only_model_is_one_line(
    mmgen_cache_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    image = _picture(tmp_path / "cat.jpg")
    code = mmgen_main(["generate", "a cat", "--image", str(image), "--device", "cpu", "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "text-to-video only" in err[0], err


def _render(tmp_path, body):
    path = tmp_path / "render.yaml"
    path.write_text(textwrap.dedent(body))
    return path


def test_render_i2v_jobs_name_their_image_problems(tmp_path):
    _picture(tmp_path / "ok.png")
    (tmp_path / "text.png").write_text("hello")
    path = _render(
        tmp_path,
        """\
        task: i2v
        jobs:
          - name: good
            prompt: a cat
            image: ok.png
          - name: gone
            prompt: a dog
            image: missing.png
          - name: broken
            prompt: a fox
            image: text.png
          - name: none
            prompt: a bird
        """,
    )
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert "jobs[1] 'gone': image: " in problems[0] and "file not found" in problems[0]
    assert "jobs[2] 'broken': image: " in problems[1] and "not a readable image" in problems[1]
    assert "jobs[3] 'none': image: task i2v needs an image" in problems[2]


def test_render_image_content_is_part_of_the_request(tmp_path):
    image = _picture(tmp_path / "in.png", value=10)
    body = """\
        task: i2v
        defaults:
          image: in.png
        jobs:
          - prompt: a cat
        """
    plan = load_render_file(_render(tmp_path, body))
    (job,) = plan.jobs
    assert job.image_sha256 == read_image(image).sha256
    assert job.fields()["image"] == str(image) and job.request.image.sha256 == job.image_sha256
    key = plan.request_key(job)
    _picture(image, value=200)  # same path, other pixels: another request
    replan = load_render_file(_render(tmp_path, body))
    assert replan.request_key(replan.jobs[0]) != key


def test_image_array_and_file_hash_alike(tmp_path):
    pixels = np.arange(4 * 6 * 3, dtype=np.uint8).reshape(4, 6, 3)
    Image.fromarray(pixels).save(tmp_path / "p.png")
    assert read_image(pixels).sha256 == read_image(tmp_path / "p.png").sha256
    assert read_image(pixels).sha256 != read_image(pixels[:, :5].copy()).sha256


def test_i2v_entry_point_requires_an_image():
    from mmgen.errors import ValidationError
    from pipelines.loader import TASKS
    from pipelines.wan_i2v import WanI2VPipeline

    assert "i2v" in TASKS
    pipe = object.__new__(WanI2VPipeline)  # the check runs before the pipeline touches its model
    with pytest.raises(ValidationError, match="WanI2VPipeline needs image="):
        pipe("a cat")
