"""The family registry: mmgen's own families found by their directories, and a family outside the
repository (tests/toy_family.py) installed the standard way, an entry point in the group
`mmgen.families` of a *.dist-info on the path, run through `mmgen generate` and `mmgen serve`
without any change to a face: the PNG it serves is the one `generate` writes for the same seed.
"""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from serve_cases import ServerProcess
from toy_family import write_toy_dir

from mmgen.errors import LoadError, ValidationError
from mmgen.families import detect, families, family_of, load_pipeline, makes_images
from mmgen.outputs.writers import frames_sha256
from pipelines.capabilities import FEATURES, TASK_REASONS, TASKS, Capabilities
from pipelines.request import GenerationRequest
from pipelines.request_properties import field_needs

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
PROMPT = "a toy on a table"


def install(site: Path, entry: str = "toy = toy_family:FAMILY") -> Path:
    """A distribution declaring `entry` in the group mmgen.families, as pip would leave it in `site`."""
    info = site / "toy_family_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-family-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[mmgen.families]\n{entry}\n")
    return site


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    """The toy family installed (in this process and in the subprocesses it starts); its model directory."""
    site = install(tmp_path / "site")
    path = os.pathsep.join([str(site), str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(str(site))
    return write_toy_dir(tmp_path / "toy-model")


def test_builtin_families_are_found_by_their_directories(default_model_dir, tmp_path):
    assert [f.name for f in families()] == ["wan", "qwen-image", "qwen-image-2.1"]
    assert family_of(default_model_dir).name == "wan" and not makes_images(default_model_dir)
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "model_index.json").write_text('{"_class_name": "QwenImageEditPipeline"}')
    assert detect(qwen).name == "qwen-image" and makes_images(qwen)
    assert family_of(default_model_dir).presets == ("distill-4step",)
    assert detect(qwen).presets == ("lightning-8step", "lightning-4step")


def test_a_directory_no_family_reads_names_every_supported_class(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    with pytest.raises(LoadError) as caught:
        load_pipeline(tmp_path, task="t2v", device="cpu", dtype="float32")
    message = str(caught.value)
    assert "_class_name is 'FluxPipeline'" in message
    for name in ("WanPipeline", "WanImageToVideoPipeline", "WanVACEPipeline", "QwenImagePipeline"):
        assert name in message, message
    every = [name for family in families() for name in family.pipeline_classes]  # 2.1's too
    assert "QwenImage21Pipeline" in every and all(name in message for name in every), message
    assert "QwenImageEditPipeline" in message and detect(tmp_path) is None and not makes_images(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoadError, match="no model_index.json and no original layout.*original Wan layout"):
        family_of(empty)


def test_every_field_need_is_a_capability_and_refusals_follow_from_them():
    known = set(TASKS) | set(FEATURES)
    needs = {name: field_needs(name)[0] for name in GenerationRequest.model_fields}
    assert all(set(need) <= known for need in needs.values()), needs
    image_only = Capabilities("image", ("t2i",))
    assert "image" not in image_only.fields and "prompt" in image_only.fields and image_only.uploads == ()
    request = GenerationRequest.from_call(prompt="x", step_cache=0.1, decode="full", fp8_linear=False)
    assert image_only.refusals(request, "T") == [
        "step_cache = 0.1: not supported by the T pipeline (no step cache yet)"
    ]
    vace = Capabilities.every_feature("video", ("t2v", "vace"))
    assert vace.uploads == ("video", "mask", "reference_images") and vace.refusals(request, "T") == []
    assert TASK_REASONS["vace"] in image_only.reason("vace_scale")
    with pytest.raises(ValidationError, match="task 'txt2img'"):
        Capabilities("image", ("txt2img",))


def test_a_broken_declaration_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.syspath_prepend(str(install(tmp_path / "a", "wan = toy_family:FAMILY")))
    with pytest.raises(LoadError, match=r"entry point wan = toy_family:FAMILY .*named 'toy'"):
        families()
    monkeypatch.syspath_prepend(str(install(tmp_path / "b", "toy = toy_family:missing")))
    with pytest.raises(LoadError, match=r"entry point toy = toy_family:missing .*cannot load"):
        families()


def test_an_installed_family_runs_through_generate_and_serve(toy, tmp_path):
    """The toy family's directory through the faces as they are: `mmgen generate` (a subprocess) writes
    its PNG; `mmgen serve` (a subprocess, HTTP on loopback) reports its capabilities, refuses what
    they exclude with a 400 naming the field, and serves the same image for the same seed."""
    assert [f.name for f in families()][-1] == "toy" and family_of(toy).name == "toy" and makes_images(toy)
    out = tmp_path / "toy.png"
    command = [sys.executable, "-m", "mmgen.cli", "generate", PROMPT, "--model", str(toy), "--device", "cpu"]
    command += ["--width", "48", "--height", "32", "--steps", "3", "--seed", "7", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    printed = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    assert out.is_file() and printed["output"] == str(out) and printed["frames"] == "1 x 32x48"
    from PIL import Image

    written = np.asarray(Image.open(out))
    assert written.shape == (32, 48, 3) and frames_sha256(written[None]) == printed["frames_sha256"]

    with ServerProcess(tmp_path / "state", toy) as server:
        status, health = server.request("GET", "/health")
        assert status == 200 and health["outputs"] == "image" and health["uploads"] == []
        assert (
            health["capabilities"]["tasks"] == ["t2i"]
            and "step_cache" not in health["capabilities"]["fields"]
        )
        models = server.request("GET", "/v1/models")[1]
        assert models["data"][0]["capabilities"] == health["capabilities"]
        body = {"prompt": PROMPT, "size": "48x32", "num_inference_steps": 3, "seed": 7}
        status, answer = server.request("POST", "/v1/images/generations", body)
        assert status == 200, answer
        served = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer["data"][0]["b64_json"]))))
        assert frames_sha256(served[None]) == printed["frames_sha256"]
        status, refused = server.request("POST", "/v1/images/generations", {**body, "step_cache": 0.1})
        assert status == 400 and refused["error"]["param"] == "step_cache", refused
        assert "not supported by the Toy pipeline (no step cache yet)" in refused["error"]["message"]
        status, refused = server.request("POST", "/v1/videos", body)
        assert status == 400 and refused["error"]["param"] == "model", refused
