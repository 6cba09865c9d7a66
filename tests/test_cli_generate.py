"""`mmgen generate` as a user runs it: separate processes, the README's command, bad input."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SHA256_LINE = re.compile(r"^frames_sha256: ([0-9a-f]{64})$", re.MULTILINE)
PROMPT = "a red fox running through a snowy forest"


def start(*args: str, cache: Path, cwd: Path) -> subprocess.Popen:
    """Start the installed `mmgen` console script (or `python -m mmgen.cli` where it is not on PATH)."""
    script = shutil.which("mmgen")
    command = [script] if script else [sys.executable, "-m", "mmgen.cli"]
    env = {**os.environ, "MMGEN_CACHE_DIR": str(cache)}
    return subprocess.Popen(
        [*command, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def frame_count(path: Path) -> int:
    import imageio.v2 as imageio

    with imageio.get_reader(path, format="FFMPEG") as reader:
        return sum(1 for _ in reader)


def test_readme_command_and_determinism_across_processes(mmgen_cache_dir, tmp_path):
    # Two separate processes (run side by side to save time) with the same seed.
    first = start("generate", PROMPT, "--frames", "5", "--seed", "7", cache=mmgen_cache_dir, cwd=tmp_path)
    second = start(
        "generate",
        PROMPT,
        "--frames",
        "5",
        "--seed",
        "7",
        "--out",
        "again.mp4",
        cache=mmgen_cache_dir,
        cwd=tmp_path,
    )
    (code, stdout, stderr), (code2, stdout2, stderr2) = finish(first), finish(second)
    assert code == 0, stderr
    output = tmp_path / "mmgen_7.mp4"  # the documented default name
    assert f"output: {output.name}" in stdout and output.is_file()
    assert frame_count(output) == 5
    (sha,) = SHA256_LINE.findall(stdout)
    assert "attention: sdpa:sdpa" in stdout
    assert code2 == 0, stderr2
    assert SHA256_LINE.findall(stdout2) == [sha]  # same seed, another process: the same frames
    assert frame_count(tmp_path / "again.mp4") == 5


def test_one_frame_writes_a_png(mmgen_cache_dir, tmp_path, monkeypatch, capsys):
    # In-process (the subprocess path is covered above): main() returns the exit code.
    import imageio.v3 as iio

    from mmgen.cli import main

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    assert main(["generate", "a cat", "--out", str(tmp_path / "cat.png"), "--steps", "2"]) == 0
    (sha,) = SHA256_LINE.findall(capsys.readouterr().out)
    image = iio.imread(tmp_path / "cat.png")
    assert image.shape == (48, 48, 3) and image.std() > 5
    from mmgen.outputs.writers import frames_sha256

    assert frames_sha256(image[None]) == sha


@pytest.fixture()
def wrong_shape_model(default_model_dir, tmp_path) -> Path:
    """A copy of the default model whose transformer has one tensor of the wrong shape."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "broken"
    shutil.copytree(default_model_dir, copy)
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    tensors["proj_out.bias"] = torch.zeros(tensors["proj_out.bias"].numel() + 1)
    save_file(tensors, weights)
    return copy


BAD_INPUT = (
    (["--model", "{tmp}/no-such-model"], "no-such-model"),
    (["--model", "{broken}"], "proj_out.bias"),
    (["--frames", "10"], "4k+1"),
    (["--height", "100"], "multiple of 16"),
    (["--backend", "nope"], "allowed"),
)


def test_bad_input_is_one_line_without_traceback(mmgen_cache_dir, wrong_shape_model, tmp_path):
    # One process per mistake, all started at once.
    runs = [
        (start("generate", "a cat", *[a.format(tmp=tmp_path, broken=wrong_shape_model) for a in args],
               cache=mmgen_cache_dir, cwd=tmp_path), reason)
        for args, reason in BAD_INPUT
    ]  # fmt: skip
    for process, reason in runs:
        code, stdout, stderr = finish(process)
        lines = stderr.strip().splitlines()
        assert code == 2, (process.args, stderr)
        assert len(lines) == 1 and lines[0].startswith("mmgen: error: "), stderr
        assert reason in lines[0], lines[0]
        assert "Traceback" not in stderr and stdout == ""
    assert not list(tmp_path.glob("*.mp4"))


def test_offload_on_the_cpu_says_it_saves_nothing(mmgen_cache_dir, tmp_path, monkeypatch, capsys):
    """--offload layer on a CPU device runs (the same frames) but the printed plan says it does nothing."""
    from mmgen.cli import main

    monkeypatch.setenv("MMGEN_CACHE_DIR", str(mmgen_cache_dir))
    common = ["--frames", "1", "--steps", "2", "--device", "cpu"]
    assert main(["generate", "a cat", "--out", str(tmp_path / "plain.png"), *common]) == 0
    plain = capsys.readouterr().out
    assert (
        main(["generate", "a cat", "--out", str(tmp_path / "layer.png"), "--offload", "layer", *common]) == 0
    )
    layer = capsys.readouterr().out
    plan = next(line for line in layer.splitlines() if line.startswith("memory_plan:"))
    assert "offload layer" in plan and "(device cpu: " in plan and "save no device memory" in plan
    assert "(device cpu" not in next(line for line in plain.splitlines() if line.startswith("memory_plan:"))
    assert SHA256_LINE.findall(layer) == SHA256_LINE.findall(plain)


CONSOLE_PROBE = """
import atexit, gc, sys
import mmgen.cli as cli

def work(args, **kwargs):  # stands in for run_generate: what the command sees while it works
    print("collecting", gc.isenabled(), "frozen", gc.get_freeze_count() > 0)
    atexit.register(print, "teardown ran")
    return 0

cli.run_generate = work
sys.argv = ["mmgen", *sys.argv[1:]]
cli.console()
"""


def test_the_console_collects_while_it_works_and_generate_skips_the_teardown(tmp_path):
    """console(): the collector is off only while the command line is parsed (the imports), then on again
    with the import-time objects frozen; `generate` ends without the interpreter's teardown (its atexit
    hooks do not run) but with its output flushed (stdout is a pipe here: block-buffered)."""
    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PYTHONUNBUFFERED", None)
    done = subprocess.run(
        [sys.executable, "-c", CONSOLE_PROBE, "generate", "a prompt"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["collecting True frozen True"], done.stdout
