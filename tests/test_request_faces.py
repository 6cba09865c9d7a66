"""Every face is made from the one request value (pipelines.request) and refuses alike.

The field sets of `mmgen generate`'s flags (read from the built parser), the render YAML job, `mmgen
ab`'s variables and the request recorded in a manifest are each GenerationRequest's, modulo the
face-only options named here; a bad value gets the request's own words on every face.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mmgen.cli import FACE_ONLY_OPTIONS, build_parser, generate_request
from mmgen.cli import main as mmgen_main
from mmgen.errors import ValidationError
from mmgen.outputs.writers import frames_sha256
from mmgen.render import ab, runner
from mmgen.render.manifest import MANIFEST_NAME, read_manifest
from mmgen.render.schema import JOB_KEYS, REQUEST_KEYS, RUN_SETTINGS, RenderConfigError, load_render_file
from pipelines.loader import check_dtype
from pipelines.request import GenerationRequest
from pipelines.request_properties import AB_VARIABLES, field_flag, fields_with_role

FIELDS = set(GenerationRequest.model_fields)
ALIASES = {"loras": "lora"}  # the render file's (and the server's) plural of `lora`


def _generate_parser() -> argparse.ArgumentParser:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = subparsers.choices["generate"]
    parser.format_help()  # its request flags are added on first use (mmgen --help imports no torch)
    return parser


def _write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


# -- the same fields on every face ---------------------------------------------------------------


def test_mmgen_help_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; from mmgen.cli import build_parser; build_parser().format_help(); print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )


def test_generate_flags_are_the_request_fields():
    parser = _generate_parser()
    flags = {action.dest: action.option_strings for action in parser._actions}
    assert set(flags) - {"help"} - set(FACE_ONLY_OPTIONS) == FIELDS
    assert not set(FACE_ONLY_OPTIONS) & FIELDS
    for name in FIELDS - {"prompt"}:
        assert flags[name] == [field_flag(name)], name
        assert parser._option_string_actions[field_flag(name)].help  # help text from the field
    assert flags["prompt"] == []  # the positional
    # today's spellings keep working
    for flag in ("--frames", "--steps", "--guidance", "--backend", "--negative-prompt", "--lora"):
        assert flag in parser._option_string_actions


def test_render_job_keys_are_the_request_fields():
    assert {ALIASES.get(key, key) for key in JOB_KEYS} - {"name"} == FIELDS
    assert {ALIASES.get(key, key) for key in REQUEST_KEYS} == FIELDS - {"prompt"}


def test_ab_variables_are_the_request_variables_plus_run_settings():
    assert {ALIASES.get(key, key) for key in ab.SET_KEYS} == {
        *AB_VARIABLES,
        *ab.RUN_VARIABLES,
        *ab.PARALLEL_SETS,
    }
    assert set(ab.RUN_VARIABLES) <= set(RUN_SETTINGS) and not set(ab.RUN_VARIABLES) & FIELDS
    assert set(AB_VARIABLES) | set(fields_with_role("job")) == FIELDS
    assert set(fields_with_role("job")) <= set(ab.JOB_IDENTITY_FIELDS)
    missing = [
        name
        for name in (*AB_VARIABLES, *ab.RUN_VARIABLES, "parallel")
        if name not in ab.DECLARED_FINGERPRINT_FIELDS
    ]
    assert not missing, f"no fingerprint allowance for ab variable(s) {missing}"


def fake_factory(plan):
    """A pipeline without a model: smooth frames from the seed; records what it was called with."""

    def generate(request, *, progress):
        prompt, seed = request.prompt, request.seed
        t, h, w = request.num_frames or 5, request.height or 16, request.width or 16
        ramp = (np.arange(w, dtype=np.int64)[None, None, :, None] * 8 + seed * 40 + len(prompt)) % 256
        frames = np.broadcast_to(ramp, (t, h, w, 3)).astype(np.uint8)
        return SimpleNamespace(
            frames=frames,
            frames_sha256=frames_sha256(frames),
            latents_sha256="0" * 64,
            timings={"denoise": 0.0},
            fingerprint={"torch": "fake"},
            attention_providers={"self": "sdpa"},
            memory={},  # no GPU: no peaks (GenerationResult's field)
            args={"fps": 8, "seed": seed},
        )

    return SimpleNamespace(generate=generate)


BATCH = """\
    model: default
    device: cpu
    defaults: {height: 32, width: 32, num_frames: 5, cfg: sequential, ffn_chunk: 4, decode: frames}
    jobs:
      - {name: cat, prompt: a cat, seed: 1, compile: true, max_sequence_length: 16}
      - {name: dog, prompt: a dog, seed: 2}
"""


def test_the_manifest_records_the_request(tmp_path):
    plan = load_render_file(_write(tmp_path / "batch.yaml", BATCH), output_dir=tmp_path / "out")
    summary = runner.run_render(plan, show_progress=False, pipeline_factory=fake_factory)
    assert not summary.failed
    records = {r["job"]["label"]: r for r in read_manifest(tmp_path / "out" / MANIFEST_NAME)}
    assert set(records["cat"]["request"]) == FIELDS
    again = GenerationRequest.from_call(**records["cat"]["request"])
    assert again == plan.jobs[0].request and again.cfg == "sequential" and again.compile is True
    assert records["cat"]["settings"]["dtype"] == "float32"


# -- the faces refuse alike ----------------------------------------------------------------------


def test_four_k_plus_one_frames_is_one_message_on_every_face(tmp_path):
    with pytest.raises(ValidationError) as python:
        GenerationRequest.from_call(prompt="a cat", num_frames=7)
    with pytest.raises(ValidationError) as cli:
        generate_request(build_parser().parse_args(["generate", "a cat", "--frames", "7"]))
    path = _write(tmp_path / "r.yaml", "jobs: [{name: cat, prompt: a cat, num_frames: 7}]\n")
    with pytest.raises(RenderConfigError) as render:
        load_render_file(path)
    words = str(python.value)
    assert words.startswith("num_frames = 7: must be 4k+1")
    assert str(cli.value) == f"--frames: {words}"
    assert render.value.problems == [f"{path}: jobs[0] 'cat': {words}"]


def test_the_python_call_refuses_in_the_same_words(default_model_dir):
    # The Python face: the pipeline's __call__ builds the same request (prepare -> run -> record).
    pytest.importorskip("pipelines.plan", reason="the pipeline builds a GenerationRequest once prepare lands")
    from pipelines.wan_t2v import WanT2VPipeline

    pipe = WanT2VPipeline.from_pretrained(default_model_dir, dtype="float32", device="cpu")
    with pytest.raises(ValidationError) as python:
        pipe("a cat", num_frames=7)
    with pytest.raises(ValidationError) as request:
        GenerationRequest.from_call(prompt="a cat", num_frames=7)
    assert str(python.value) == str(request.value)


@pytest.mark.parametrize("spelling", ["fp16", "float16"])
def test_both_dtype_spellings_on_every_face(tmp_path, spelling, monkeypatch, capsys):
    assert str(check_dtype(spelling)) == "torch.float16"
    plan = load_render_file(_write(tmp_path / "r.yaml", f"dtype: {spelling}\njobs: [{{prompt: x}}]\n"))
    assert plan.dtype == "float16"
    captured = {}

    def no_load(model, **kwargs):
        captured.update(kwargs)
        raise ValidationError("stop before loading")

    monkeypatch.setattr("mmgen.executors.in_process._load", no_load)  # where generate loads
    out = str(tmp_path / "x.mp4")
    assert mmgen_main(["generate", "x", "--dtype", spelling, "--device", "cpu", "--out", out]) == 2
    assert captured["dtype"] == "float16" and "stop before loading" in capsys.readouterr().err
    for bad in (
        ["generate", "x", "--dtype", "int8"],
        ["enhance", "x", "--model", str(tmp_path), "--dtype", "int8", "--device", "cpu"],
    ):
        assert mmgen_main(bad) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "dtype 'int8': allowed torch.float32" in err and "fp16" in err, err


def test_a_huge_height_fails_before_any_model_loads(monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("mmgen.executors.in_process._load", no_load)  # where generate loads
    assert mmgen_main(["generate", "a cat", "--height", "16384", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err == "mmgen: error: --height: height = 16384: must be at most 8192 pixels\n"


def test_new_generate_flags_reach_the_request():
    args = ["generate", "a cat", "--cfg", "sequential", "--ffn-chunk", "8", "--block-chunk", "4"]
    args += ["--decode", "frames", "--compile", "--max-sequence-length", "16", "--lora-mode", "unfused"]
    request = generate_request(build_parser().parse_args(args))
    assert request.fields_set() == {
        "prompt": "a cat",
        "seed": 0,  # the command line's own default: the same command, the same frames
        "cfg": "sequential",
        "ffn_chunk": 8,
        "block_chunk": 4,
        "decode": "frames",
        "compile": True,
        "max_sequence_length": 16,
        "lora_mode": "unfused",
    }
    with pytest.raises(
        ValidationError, match="^--ffn-chunk: ffn_chunk = 0: should be greater than or equal to 1$"
    ):
        generate_request(build_parser().parse_args(["generate", "x", "--ffn-chunk", "0"]))
    # a check that already names the flag is not prefixed twice
    with pytest.raises(
        ValidationError, match=r"^--lora 'x\.safetensors:abc': strength 'abc' is not a number"
    ):
        generate_request(build_parser().parse_args(["generate", "x", "--lora", "x.safetensors:abc"]))


def test_output_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a directory")
    path = _write(tmp_path / "r.yaml", "output_dir: taken\njobs: [{prompt: x}]\n")
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    assert info.value.problems == [
        f"{path}: output_dir: {tmp_path / 'taken'} is a file, not a directory (name a directory for the outputs)"
    ]
    assert mmgen_main(["render", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "output_dir: " in err and "Errno" not in err


# -- no lost work --------------------------------------------------------------------------------


def test_generate_without_out_never_replaces_a_file(mmgen_cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    monkeypatch.chdir(tmp_path)
    first = tmp_path / "mmgen_0.png"
    first.write_bytes(b"an earlier result")
    argv = ["generate", "a cat", "--frames", "1", "--steps", "1", "--device", "cpu", "--no-progress"]
    assert mmgen_main(argv) == 0
    assert "output: mmgen_0_1.png" in capsys.readouterr().out
    assert first.read_bytes() == b"an earlier result" and (tmp_path / "mmgen_0_1.png").stat().st_size > 0
    assert mmgen_main(["generate", "a dog", *argv[2:]]) == 0
    assert "output: mmgen_0_2.png" in capsys.readouterr().out
    # --out names the file: then it is replaced
    assert mmgen_main([*argv, "--out", str(first)]) == 0
    assert first.read_bytes() != b"an earlier result"


def test_an_edited_render_file_names_the_changed_fields_and_check_predicts_it(tmp_path, capsys):
    path = _write(tmp_path / "batch.yaml", BATCH)
    out = tmp_path / "out"
    runner.run_render(
        load_render_file(path, output_dir=out), show_progress=False, pipeline_factory=fake_factory
    )
    _write(path, BATCH.replace("num_frames: 5, cfg: sequential", "num_frames: 9, cfg: batch"))
    expected = "cat_s1.mp4 (job cat) was rendered by"
    changed = "changed: num_frames 5 -> 9, cfg 'sequential' -> 'batch'"
    assert mmgen_main(["render", str(path), "--out", str(out), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to overwrite outputs of a different request" in err
    assert expected in err and changed in err, err
    with pytest.raises(Exception, match="refusing to overwrite") as info:
        runner.run_render(
            load_render_file(path, output_dir=out), show_progress=False, pipeline_factory=fake_factory
        )
    assert changed in str(info.value)
    # a record written before the request value (only the fields its file set) is diffed the same way
    manifest = out / MANIFEST_NAME
    records = [json.loads(line) for line in manifest.read_text().splitlines()]
    for record in records:
        record.pop("settings")
        record["request"] = {
            "prompt": record["request"]["prompt"],
            "seed": record["request"]["seed"],
            "num_frames": 5,
        }
    manifest.write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(Exception, match="refusing to overwrite") as info:
        runner.run_render(
            load_render_file(path, output_dir=out), show_progress=False, pipeline_factory=fake_factory
        )
    assert "height None -> 32" in str(info.value) and "num_frames 5 -> 9" in str(info.value)
    assert "seed" not in str(info.value).partition("changed: ")[2].partition(";")[0]
    # --no-resume replaces them, and --check says so
    assert mmgen_main(["render", str(path), "--out", str(out), "--check", "--no-resume"]) == 0
    assert "2 to render" in capsys.readouterr().out


def test_ab_refuses_a_job_field_as_its_variable(tmp_path):
    path = _write(tmp_path / "batch.yaml", BATCH)
    with pytest.raises(
        ValidationError, match="--set num_inference_steps: not a variable a candidate may vary"
    ):
        ab.run_ab(
            path, sets=["num_inference_steps=2"], out_dir=tmp_path / "ab", pipeline_factory=fake_factory
        )


def test_every_mistake_of_a_file_in_one_report(tmp_path):
    # a bad top level does not hide the jobs' mistakes, a bad field not a conflict across fields
    text = """\
        dtype: int8
        defaults: {offload: disk, accel: fast, step_cache: 1.0}
        jobs:
          - {name: a, prompt: a cat, num_frames: 7, colour: red}
    """
    path = _write(tmp_path / "r.yaml", text)
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    problems = [line.removeprefix(f"{path}: ") for line in info.value.problems]
    assert [line.split(":")[0].split(" = ")[0] for line in problems] == [
        "dtype",
        "defaults.offload",
        "defaults.step_cache",
        "jobs[0] 'a'",
        "jobs[0] 'a'",
    ], problems
    assert problems[0].startswith("dtype: 'int8': allowed torch.float32")
