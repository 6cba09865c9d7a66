"""The check before `--gpus` spawns asks the model's family (mmgen.families): its heads, as the family
reads them from its config (Wan: transformer/config.json's num_attention_heads or the original num_heads;
Qwen-Image-2.1: its transformer config), against the Ulysses degree; a ring only where its attention
runs one; several processes only where it runs them. Tiny random directories of each family; nothing
spawns (run_parallel fails the test if called) and no weights are read."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from mmgen.cli import main
from mmgen.errors import ValidationError
from mmgen.families import model_heads
from mmgen.parallel.layout import ParallelConfig

pytest.importorskip("diffusers")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def q21_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from qwen_image21_pipeline_cases import tiny_parts, write_qwen_image21_dir

    root = tmp_path_factory.mktemp("q21dir")
    return write_qwen_image21_dir(root, tiny_parts(root), None)


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    from mmgen.parallel import launch

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("run_parallel was called: the check came after the ranks started")

    monkeypatch.setattr(launch, "run_parallel", refuse)
    monkeypatch.setattr(launch, "run_worlds", refuse)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def config_heads(directory: Path) -> int:
    return json.loads((directory / "transformer" / "config.json").read_text())["num_attention_heads"]


def refusal(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line `mmgen ARGV` prints (exit code 2)."""
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_qwen_image21_gpus_that_do_not_split_its_heads_are_refused_before_any_rank_spawns(
    q21_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], no_spawn: None
) -> None:
    heads = config_heads(q21_dir)
    assert heads == 2 and model_heads(q21_dir) == heads  # the tiny 2.1 transformer: 2 heads
    generate = ["generate", "x", "--model", str(q21_dir), "--device", "cpu", "--out", str(tmp_path / "o.png")]
    line = refusal(capsys, [*generate, "--gpus", "3"])
    assert line.endswith(
        "--gpus 3: Qwen-Image-2.1's 2 attention heads do not split over Ulysses degree 3 (its attention "
        "runs Ulysses only, no ring: --sp is the Ulysses degree); allowed: --sp 1 or 2, so --gpus 1 or 2"
    ), line
    line = refusal(capsys, [*generate, "--gpus", "6", "--cfg-parallel"])
    assert "--gpus 6 with --cfg-parallel: Qwen-Image-2.1's 2 attention heads" in line
    assert line.endswith("allowed: --sp 1 or 2, so --gpus 2 or 4 with --cfg-parallel"), line
    # its segment attention runs no ring: a ring that would make the heads split is refused too
    line = refusal(capsys, [*generate, "--gpus", "2", "--ring", "2"])
    assert "--ring 2: Qwen-Image-2.1's attention runs no ring; use --ring 1" in line
    assert "--sp dividing its 2 attention heads (1 or 2)" in line
    # the server: before anything binds; a render's groups: before any group spawns
    serve = ["serve", "--state", str(tmp_path / "state"), "--model", str(q21_dir), "--device", "cpu"]
    assert "Ulysses degree 4" in refusal(capsys, [*serve, "--gpus", "4"])
    assert not (tmp_path / "state").exists()
    render = tmp_path / "render.yaml"
    render.write_text(
        textwrap.dedent(f"""\
        model: {q21_dir}
        device: cpu
        jobs:
          - {{name: a, prompt: a cat, seed: 1}}
        """)
    )
    argv = ["render", str(render), "--out", str(tmp_path / "out"), "--gpus", "3", "--sp", "3"]
    assert "2 attention heads do not split over Ulysses degree 3" in refusal(capsys, argv)
    assert not (tmp_path / "out" / "manifest.jsonl").exists()


def test_layouts_a_family_runs_pass_and_one_process_families_are_refused(
    q21_dir: Path, qwen_image_dir: Path, default_model_dir: Path, tmp_path: Path, capsys, no_spawn
) -> None:
    from mmgen.executors.launch import check_parallel_model

    for config in (ParallelConfig(sp=2), ParallelConfig(sp=2, cfg=True), ParallelConfig(cfg=True)):
        check_parallel_model(config, q21_dir)  # Ulysses 2 splits 2 heads; CFG parallel splits none
    # Wan (the default model) runs a ring: Ulysses 1 x ring 2 takes any head count
    assert model_heads(default_model_dir) == config_heads(default_model_dir)
    check_parallel_model(ParallelConfig(sp=2, ring=2), default_model_dir)
    heads = config_heads(default_model_dir)
    with pytest.raises(ValidationError, match=rf"{heads} attention heads do not split .*\(--ring\)"):
        check_parallel_model(ParallelConfig(sp=heads + 1), default_model_dir)
    # Qwen-Image runs in one process: refused by its family before any rank loads, whatever its heads
    argv = ["generate", "x", "--model", str(qwen_image_dir), "--device", "cpu", "--gpus", "2"]
    line = refusal(capsys, [*argv, "--out", str(tmp_path / "o.png")])
    assert "--gpus 2: not supported by the Qwen-Image pipeline (it runs in one process" in line
    assert line.endswith("use --gpus 1"), line
