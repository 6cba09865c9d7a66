"""mmgen.layers.compile_guard.not_compiled: what `torch.compiler.disable` does (a graph break, the
function run eagerly, outside dynamo) without importing torch._dynamo when the module loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from mmgen.layers.compile_guard import not_compiled

ROOT = Path(__file__).resolve().parents[1]


def test_importing_the_guarded_modules_imports_no_dynamo():
    code = (
        "import sys, mmgen.layers.compile_guard, mmgen.layers.fp8_linear, mmgen.models.wan_blocks\n"
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    assert done.stdout.strip() == "False"


def test_under_torch_compile_the_function_runs_eagerly_between_graphs():
    seen = []

    @not_compiled
    def host_side(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())  # False: run by Python, not traced
        return x * float(x.sum().item() > 0)  # data-dependent Python: no single graph holds it

    def f(x: torch.Tensor) -> torch.Tensor:
        return host_side(x.sin()) + 1

    x = torch.randn(8, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(f, backend="eager")
    first, second = compiled(x), compiled(x)
    assert seen == [False, False]  # once per call, never during tracing
    expected = x.sin() * float(x.sin().sum().item() > 0) + 1
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert host_side.__name__ == "host_side" and host_side(torch.ones(2)).tolist() == [1.0, 1.0]
