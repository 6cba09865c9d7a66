"""Per-variant generation defaults: a directory without mmgen_defaults.json gets the size its checkpoint
was trained for, decided from model_index.json (the path only for Wan2.1 I2V 480P vs 720P), and the
pipeline's manifest and the CLI say where the values came from."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mmgen.loading.diffusers_dir import load_wan_components
from mmgen.loading.wan_components import DEFAULTS_FILE, GenerationDefaults, variant_generation_defaults


@pytest.mark.parametrize(
    ("flags", "name", "expected", "mark"),
    [
        ({"expand_timesteps": True}, "model", (704, 1280, 121, 24), "TI2V-5B"),
        ({"two_experts": True}, "model", (720, 1280, 81, 16), "A14B"),
        ({"image_encoder": True}, "Wan2.1-I2V-14B-720P-Diffusers", (720, 1280, 81, 16), "720P"),
        ({"image_encoder": True}, "Wan2.1-I2V-14B-480P-Diffusers", (480, 832, 81, 16), "480P"),
        ({"image_encoder": True}, "my-i2v", (480, 832, 81, 16), "does not name 720P"),
        ({}, "model", (480, 832, 81, 16), "Wan2.1 T2V"),
    ],
)
def test_each_variant_defaults_to_its_trained_size(tmp_path, flags, name, expected, mark):
    directory = tmp_path / name
    directory.mkdir()
    args = {"expand_timesteps": False, "two_experts": False, "image_encoder": False, **flags}
    defaults = variant_generation_defaults(directory, **args)
    assert (defaults.height, defaults.width, defaults.num_frames, defaults.fps) == expected
    assert mark in defaults.chosen_by
    assert f"{expected[0]}x{expected[1]}" in defaults.chosen_by


def test_a_720p_release_is_recognised_from_a_parent_folder(tmp_path):
    # The Hugging Face cache keeps the repository's name in a parent folder, not the snapshot's.
    directory = tmp_path / "models--Wan-AI--Wan2.1-I2V-14B-720P-Diffusers" / "snapshots" / "0123abcd"
    directory.mkdir(parents=True)
    defaults = variant_generation_defaults(
        directory, expand_timesteps=False, two_experts=False, image_encoder=True
    )
    assert (defaults.height, defaults.width) == (720, 1280)


def test_defaults_file_wins_and_cannot_set_chosen_by(tmp_path):
    path = tmp_path / DEFAULTS_FILE
    defaults = GenerationDefaults.from_dict({"height": 64}, source=path)
    assert defaults.height == 64 and defaults.chosen_by == str(path)
    assert "chosen_by" not in defaults.to_dict()
    with pytest.raises(Exception, match="unknown key"):
        GenerationDefaults.from_dict({"chosen_by": "x"}, source=path)


def _variant_dir(default_model_dir: Path, tmp_path: Path, **index_changes) -> Path:
    directory = tmp_path / "variant"
    shutil.copytree(default_model_dir, directory)
    (directory / DEFAULTS_FILE).unlink()
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    index.update(index_changes)
    index_path.write_text(json.dumps(index))
    return directory


def test_loaded_ti2v_directory_takes_ti2v_defaults_and_the_manifest_says_so(default_model_dir, tmp_path):
    from pipelines.wan_t2v import WanT2VPipeline

    directory = _variant_dir(default_model_dir, tmp_path, expand_timesteps=True)
    components = load_wan_components(directory)
    d = components.defaults
    assert (d.height, d.width, d.num_frames, d.fps) == (704, 1280, 121, 24)
    pipe = WanT2VPipeline.from_pretrained(directory)
    result = pipe("a fox", height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)
    assert "TI2V-5B" in result.args["defaults"] and result.args["fps"] == 24


def test_loaded_two_expert_directory_takes_a14b_defaults(default_model_dir, tmp_path):
    directory = _variant_dir(
        default_model_dir,
        tmp_path,
        transformer_2=["diffusers", "WanTransformer3DModel"],
        boundary_ratio=0.875,
    )
    shutil.copytree(directory / "transformer", directory / "transformer_2")
    d = load_wan_components(directory).defaults
    assert (d.height, d.width, d.num_frames, d.fps) == (720, 1280, 81, 16)
    assert "A14B" in d.chosen_by


def test_directory_with_a_defaults_file_keeps_it(default_model_dir):
    d = load_wan_components(default_model_dir).defaults
    assert d.chosen_by.endswith(DEFAULTS_FILE)
