"""mmgen.layers.compile_guard.not_compiled: what `torch.compiler.disable` does (a graph break, the
function run eagerly, outside dynamo) without importing torch._dynamo when the module loads; and
opaque_op: a custom op in compiled graphs, a plain call in eager code (whose first custom-op call would
import torch._dynamo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from mmgen.layers.compile_guard import not_compiled, opaque_op

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


EAGER_OP = """
import sys, torch
from mmgen.layers.compile_guard import opaque_op

@opaque_op("mmgen_guard_check::twice", device_types="cpu")
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@twice.register_fake
def _(x):
    return torch.empty_like(x)

print(twice(torch.ones(3)).tolist(), 'torch._dynamo' in sys.modules)
"""


def test_an_opaque_ops_eager_call_imports_no_dynamo():
    # A torch.library.custom_op's first call imports torch._dynamo, sympy and torch.distributed: what
    # every `mmgen generate` on CUDA paid at its first step (~7 s on a GPU host without bytecode caches).
    done = subprocess.run(
        [sys.executable, "-c", EAGER_OP], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    )
    assert done.stdout.split("\n")[-2] == "[2.0, 2.0, 2.0] False"


def test_under_torch_compile_an_opaque_op_is_one_node_of_the_graph():
    ran = []

    @opaque_op("mmgen_guard_check::scaled", device_types="cpu")
    def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
        ran.append(torch.compiler.is_compiling())
        return x * factor

    @scaled.register_fake
    def _(x, factor):
        return torch.empty_like(x)

    graphs = []

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        graphs.append(graph)
        return graph.forward

    x = torch.randn(4, generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(lambda t: scaled(t.sin(), 3.0) + 1, backend=backend, fullgraph=True)
    torch.testing.assert_close(compiled(x), x.sin() * 3.0 + 1)
    targets = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    assert "mmgen_guard_check.scaled.default" in targets  # the op itself, not its traced body
    assert ran == [False]  # run once, by the graph's call of the op (not traced into)
    torch.testing.assert_close(scaled(x, 2.0), x * 2.0)
    assert scaled.__name__ == "scaled" and ran == [False, False]
