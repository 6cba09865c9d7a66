"""Render YAML validation: every mistake in one report naming file, job and field, before any model loads."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from mmgen.cli import main as mmgen_main
from mmgen.render import runner
from mmgen.render.schema import RenderConfigError, apply_overrides, load_render_file


def _write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


FOUR_MISTAKES = """\
    model: default
    defaults:
      height: 32
      width: 32
      steps: 2               # mistake 1: unknown key (num_inference_steps)
    jobs:
      - name: cat
        prompt: a cat
        height: 100          # mistake 2: not a multiple of 16
      - name: dog
        prompt: a dog
        num_frames: 10       # mistake 3: not 4k+1
      - prompt: a fox
        guidance_scale: high # mistake 4: wrong type
"""


def test_four_mistakes_reported_together(tmp_path):
    path = _write(tmp_path / "bad.yaml", FOUR_MISTAKES)
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert all(line.startswith(f"{path}: ") for line in problems)
    by_field = {
        field: line
        for line in problems
        for field in ("steps", "height", "num_frames", "guidance_scale")
        if field in line
    }
    assert "defaults.steps: unknown key" in by_field["steps"]
    assert "jobs[0] 'cat': height = 100: must be a positive multiple of 16" in by_field["height"]
    assert "jobs[1] 'dog': num_frames = 10: must be 4k+1" in by_field["num_frames"]
    assert "jobs[2]: guidance_scale = 'high': must be a finite number" in by_field["guidance_scale"]
    assert str(info.value).startswith("4 mistakes in the render file:")


def test_cli_reports_all_and_exits_nonzero_before_any_model_load(tmp_path, monkeypatch, capsys):
    path = _write(tmp_path / "bad.yaml", FOUR_MISTAKES)

    def no_model(plan):
        raise AssertionError("a model was loaded for an invalid file")

    monkeypatch.setattr(runner, "load_pipeline", no_model)
    code = mmgen_main(["render", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0] == "mmgen: error: 4 mistakes in the render file:" and len(lines) == 5, lines
    assert all(line.startswith(f"  {path}: ") for line in lines[1:])
    for needle in (
        "defaults.steps",
        "jobs[0] 'cat': height",
        "jobs[1] 'dog': num_frames",
        "jobs[2]: guidance_scale",
    ):
        assert needle in err
    assert not (tmp_path / "out").exists()


def test_missing_prompts_file_is_one_clear_line(tmp_path, capsys):
    path = _write(tmp_path / "p.yaml", "prompts_file: nowhere.txt\n")
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    assert info.value.problems == [f"{path}: prompts_file: {tmp_path / 'nowhere.txt'} does not exist"]
    assert mmgen_main(["render", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmgen: error: {path}: prompts_file: {tmp_path / 'nowhere.txt'} does not exist"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("model: [unclosed\n  x: 1\n", "not valid YAML at line 2, column 4"),
        ("- just\n- a list\n", "the top level must be a mapping"),
        ("", "the top level must be a mapping (model, defaults, jobs, ...), got empty"),
    ],
)
def test_unreadable_yaml_is_one_clear_line(tmp_path, capsys, text, expected):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert mmgen_main(["render", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"mmgen: error: {path}: ") and expected in err[0], err


def test_missing_and_binary_yaml(tmp_path):
    with pytest.raises(RenderConfigError, match="no such file"):
        load_render_file(tmp_path / "absent.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(RenderConfigError) as info:
        load_render_file(binary)
    assert len(info.value.problems) == 1 and str(binary) in info.value.problems[0]


def test_jobs_resolve_defaults_seeds_and_stable_names(tmp_path):
    path = _write(
        tmp_path / "ok.yaml",
        """\
        defaults: {height: 32, width: 48, num_frames: 5, negative_prompt: ugly}
        seeds: {increment_from: 100}
        jobs:
          - {name: a, prompt: first}
          - {prompt: second, seed: 7, width: 64}
          - {prompt: third}
        """,
    )
    plan = load_render_file(path, output_dir=tmp_path / "out")
    assert [j.stem for j in plan.jobs] == ["a_s100", "job001_s7", "job002_s102"]
    assert plan.jobs[1].fields() == {
        "height": 32,
        "width": 64,
        "num_frames": 5,
        "negative_prompt": "ugly",
    }
    assert plan.output_dir == tmp_path / "out"
    # The key is stable and depends on what decides the output.
    again = load_render_file(path, output_dir=tmp_path / "elsewhere")
    assert [plan.request_key(j) for j in plan.jobs] == [again.request_key(j) for j in again.jobs]
    assert plan.request_key(plan.jobs[0]) != plan.request_key(plan.jobs[2])


def test_prompts_file_text_and_jsonl(tmp_path):
    (tmp_path / "p.txt").write_text("# comment\nfirst prompt\n\nsecond prompt\n")
    path = _write(tmp_path / "t.yaml", "prompts_file: p.txt\nseeds: {listed: [5, 9]}\n")
    plan = load_render_file(path)
    assert [(j.label, j.prompt, j.seed) for j in plan.jobs] == [
        ("job000", "first prompt", 5),
        ("job001", "second prompt", 9),
    ]

    (tmp_path / "p.jsonl").write_text(
        '{"name": "x", "prompt": "one", "height": 48}\n{"prompt": "two", "num_frames": 6, "colour": 1}\n'
    )
    path = _write(tmp_path / "j.yaml", "prompts_file: p.jsonl\nseeds: {fixed: 3}\n")
    with pytest.raises(RenderConfigError) as info:
        load_render_file(path)
    problems = info.value.problems
    assert len(problems) == 2
    assert any("p.jsonl: line 2: num_frames = 6" in p for p in problems)
    assert any("p.jsonl: line 2: colour: unknown key" in p for p in problems)

    (tmp_path / "p.jsonl").write_text('{"name": "x", "prompt": "one", "height": 48}\n')
    plan = load_render_file(path)
    assert plan.jobs[0].stem == "x_s3" and plan.jobs[0].fields() == {"height": 48}


def test_structural_mistakes(tmp_path):
    cases = {
        "both": ("prompts_file: a.txt\njobs: [{prompt: x}]\n", "exactly one of 'jobs'"),
        "neither": ("model: default\n", "exactly one of 'jobs'"),
        "listed": ("seeds: {listed: [1, 2]}\njobs: [{prompt: x}]\n", "2 seeds for 1 jobs"),
        "policy": ("seeds: {fixed: 1, increment_from: 2}\njobs: [{prompt: x}]\n", "set exactly one of fixed"),
        "dupe": (
            "jobs: [{name: a, prompt: x}, {name: a, prompt: y}]\n",
            "output name 'a_s0' is also used by jobs[0]",
        ),
        "prompt": ("jobs: [{name: a}]\n", "jobs[0] 'a': prompt: required"),
        "backend": (
            "defaults: {attention_backend: fast}\njobs: [{prompt: x}]\n",
            "attention_backend = 'fast': unknown",
        ),
        "name": ("jobs: [{name: 'a/b', prompt: x}]\n", "name"),
        "t2i": ("task: t2i\ndefaults: {num_frames: 5}\njobs: [{prompt: x}]\n", "task t2i renders one frame"),
        "model": ("model: no/such/dir\njobs: [{prompt: x}]\n", "is not a directory"),
    }
    for key, (text, expected) in cases.items():
        path = tmp_path / f"{key}.yaml"
        path.write_text(text)
        with pytest.raises(RenderConfigError) as info:
            load_render_file(path)
        assert any(expected in p for p in info.value.problems), (key, info.value.problems)


def test_overrides_apply_to_defaults_and_every_job(tmp_path):
    raw = {
        "defaults": {"height": 32},
        "jobs": [{"prompt": "a", "attention_backend": "flash"}, {"prompt": "b"}],
    }
    out = apply_overrides(
        raw, ["attention_backend=sdpa", "dtype=bfloat16", "height=48"], source=tmp_path / "x.yaml"
    )
    assert out["dtype"] == "bfloat16"
    assert out["defaults"] == {"height": 48, "attention_backend": "sdpa"}
    assert out["jobs"] == [{"prompt": "a", "attention_backend": "sdpa"}, {"prompt": "b"}]
    assert raw["jobs"][0]["attention_backend"] == "flash"  # the input is not modified
    with pytest.raises(RenderConfigError, match="--set colour: unknown key"):
        apply_overrides(raw, ["colour=red"], source=tmp_path / "x.yaml")
    with pytest.raises(RenderConfigError, match="expected key=value"):
        apply_overrides(raw, ["dtype"], source=tmp_path / "x.yaml")


def test_example_prompts_files_parse(tmp_path):
    configs = Path(__file__).resolve().parents[1] / "configs"
    plan = load_render_file(configs / "render_prompts_file.yaml")
    assert [(j.label, j.seed) for j in plan.jobs] == [("job000", 11), ("job001", 22), ("job002", 33)]
    path = _write(
        tmp_path / "j.yaml", f"prompts_file: {configs / 'render_prompts.jsonl'}\nseeds: {{fixed: 1}}\n"
    )
    plan = load_render_file(path)
    assert [j.stem for j in plan.jobs] == ["red_circle_s1", "blue_star_s1", "yellow_square_s1"]
    assert plan.jobs[1].fields() == {"guidance_scale": 5.0}
