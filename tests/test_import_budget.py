"""What a command imports before it needs it: the start-up budget, checked by module name, not by time.

`mmgen --help` and every subcommand's --help import no torch; the modules `mmgen generate` imports
before any model loads (the CLI, the request, the loader) import none of the heavy libraries only
other commands or other models use (diffusers: the VAE and scheduler, imported by their loaders;
transformers: Qwen-Image's text encoder; fastapi/uvicorn: serve; scipy/skimage: `ab`; ray: --ray;
torch._dynamo and sympy: torch.compile, see mmgen.layers.compile_guard). The default model's whole
`mmgen generate` imports none of them either: its scheduler and VAE decoder are mmgen's, and the
checkpoint loads build modules on the meta device without torch's meta refs (mmgen.layers.meta_init).
Each case runs in a fresh interpreter and reads sys.modules, so a timing-noisy machine cannot fail it
and a new eager import of one of these can.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Imported only by the commands and models that use them.
# sympy comes only with torch._dynamo (torch.compile), which mmgen imports when something compiles.
LIBRARIES = ("diffusers", "transformers", "peft", "fastapi", "uvicorn", "scipy", "skimage", "ray", "sympy")
# What a --help needs none of: the libraries above, torch, and the progress bar's tqdm.
HELP_FREE = (*LIBRARIES, "torch", "tqdm")
# What the embedded default model's whole `mmgen generate` needs none of: its scheduler and VAE decoder
# are mmgen's (diffusers' package import, with transformers, peft and scipy.stats, is ~2.5 s on a
# 2-core CPU); nothing compiles, so neither torch._dynamo (+ sympy, ~1-5 s) nor Inductor nor Triton.
GENERATE_FREE = (
    *LIBRARIES,
    "torch._dynamo",
    "torch._inductor",
    "triton",
    "torch.fx.experimental.symbolic_shapes",
)


def imported_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """Top-level package names in sys.modules after a fresh interpreter runs `code`."""
    names = modules_after(code, env)
    return {name.partition(".")[0] for name in names}


def modules_after(code: str, env: dict[str, str] | None = None) -> set[str]:
    """Every module name in sys.modules after a fresh interpreter runs `code` (env: added variables)."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    env = {
        **os.environ,
        **(env or {}),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def help_probe(argv: list[str]) -> str:
    # The command's own entry point; --help exits 0 through SystemExit.
    return (
        "import contextlib, io, mmgen.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        f"    mmgen.cli.main({argv!r})"
    )


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["render", "--help"], ["ab", "--help"], ["enhance", "--help"]]
)
def test_help_imports_no_torch_nor_heavy_libraries(argv):
    loaded = imported_after(help_probe(argv)) & set(HELP_FREE)
    assert not loaded, f"`mmgen {' '.join(argv)}` imports {sorted(loaded)}"


def test_generate_before_the_model_loads_imports_no_other_commands_libraries():
    # What run_generate imports up to load_pipeline, plus the generate --help flags (the request).
    code = (
        help_probe(["generate", "--help"])
        + "\nimport pipelines.loader, mmgen.families, mmgen.executors.launch, mmgen.executors.in_process"
        + "\nimport mmgen.executors.jobs, mmgen.executors.group_link, mmgen.render.face_request"
    )
    loaded = imported_after(code)
    assert "torch" in loaded  # the probe did import the generate path
    assert not loaded & set(LIBRARIES), f"generate's path imports {sorted(loaded & set(LIBRARIES))}"


def test_the_default_models_generate_imports_no_diffusers_nor_compiler(tmp_path):
    # The README's first command, whole, on a fresh cache: build the model directory, load, denoise,
    # decode, write the video.
    out = tmp_path / "x.mp4"
    code = (
        "import mmgen.cli\n"
        f"assert mmgen.cli.main(['generate', 'a red circle moves right on a black background', "
        f"'--steps', '2', '--out', {str(out)!r}]) in (0, None)"
    )
    loaded = modules_after(code, {"MMGEN_CACHE_DIR": str(tmp_path / "cache")})
    assert out.is_file() and "torch" in loaded
    tops = {name.partition(".")[0] for name in loaded}
    heavy = sorted(name for name in GENERATE_FREE if name in (loaded if "." in name else tops))
    assert not heavy, f"`mmgen generate` on the default model imports {heavy}"


def test_the_probe_sees_an_eager_import():
    # The check can fail: a module that imports diffusers at the top is seen.
    assert "diffusers" in imported_after("import diffusers")
