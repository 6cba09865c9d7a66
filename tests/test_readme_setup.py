"""What a new user meets first: the README's commands as a shell runs them and `pip install -e .`'s extras.

- `--expect psnr>=40` unquoted is a shell redirection (a file `=40`): every example quotes it;
- the first command's ./mmgen_<seed>.mp4 at the repository root is ignored by git;
- Qwen-Image's text encoder needs transformers, the `qwen` extra: without it `mmgen generate
  --model QWEN_DIR` is one error line naming the extra (README names it too).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "docs").glob("*.md")))


def test_psnr_floors_are_quoted_for_the_shell():
    unquoted = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"--expect\s+psnr", line)
    ]
    assert not unquoted, unquoted


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_the_first_commands_output_is_ignored_by_git():
    for name in ("mmgen_0.mp4", "mmgen_7_1.mp4", "mmgen_3.png"):
        done = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT, capture_output=True)
        assert done.returncode == 0, f"{name} at the repository root is not ignored"
    done = subprocess.run(["git", "check-ignore", "-q", "docs/default_model.png"], cwd=ROOT)
    assert done.returncode == 1  # only the root's generated files


def test_qwen_extra_is_declared_and_documented():
    # (tomllib is Python 3.11+; the project supports 3.10)
    extra = re.search(r"^qwen = \[(.*)\]", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert extra is not None and '"transformers>=' in extra.group(1)
    assert 'pip install -e ".[qwen]"' in (ROOT / "README.md").read_text()


def test_a_qwen_model_without_transformers_is_one_line_naming_the_extra(qwen_image_dir, tmp_path):
    # a transformers package that fails to import stands first on the path: what a plain `pip install -e .` has
    blocked = tmp_path / "blocked" / "transformers"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError(\"No module named 'transformers'\")\n")
    path = os.pathsep.join([str(blocked.parent), os.environ.get("PYTHONPATH", str(ROOT))])
    command = [sys.executable, "-m", "mmgen.cli", "generate", "a red cat", "--model", str(qwen_image_dir)]
    flags = ["--height", "32", "--width", "48", "--steps", "2", "--device", "cpu", "--out", "cat.png"]
    done = subprocess.run(
        [*command, *flags],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = done.stderr.splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("mmgen: error: ") and 'pip install -e ".[qwen]"' in lines[0], lines[0]
    assert not (tmp_path / "cat.png").exists()
