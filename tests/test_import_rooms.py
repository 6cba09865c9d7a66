"""Rooms point down: no import circle between the rooms of mmgen/ and pipelines/, nor between the files
of one room; the runtime imports no product (static, ast).

A room is a folder directly under mmgen/ (its sub-folders belong to it: mmgen/llm/models is part of
mmgen.llm), a module directly in mmgen/ (mmgen.cli, mmgen.errors, ...), or pipelines/ as a whole.
Every import counts, including those inside functions and under TYPE_CHECKING: a lazy import is
still an arrow. An arrow one way is fine (mmgen.render -> pipelines); arrows both ways, directly or
around a longer circle, fail with the import lines that make each arrow. The same holds between the
files (modules) inside a room: what two files both need moves down into a third.

The runtime imports no product: only the faces (FACES), the executors below them, which run
pipelines, and the family registry (mmgen.families, the products' index: it names each family's
pipeline loader) import `pipelines`; nothing below them imports the registry (pipelines would make a
circle with it), and the faces ask the registry rather than import a family's own modules. The serve
face imports nothing of the render face: what both need (jobs, executors, the one stop signal) lives
in mmgen.executors, below both. The default model's
prompt scorer (mmgen.tiny.detector) is handed to `ab` by its face, mmgen/render/cli.py, the one file
of mmgen.render that imports mmgen.tiny.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mmgen", "pipelines")
FACES = ("mmgen.cli", "mmgen.render", "mmgen.serve")
RUNS_PIPELINES = (*FACES, "mmgen.executors")  # the rooms that may import pipelines (products)
# The family registry indexes the products (each family's loader and capabilities live in pipelines), so
# it imports pipelines too; it sits between the faces and pipelines: the faces import it, pipelines not.
PRODUCT_INDEX = "mmgen.families"
# A family's own modules (its pipeline, variant, directory reader): only the registry imports them.
FAMILY_MODULE = re.compile(r"^(pipelines|mmgen\.loading|mmgen\.models)\.(wan|qwen)")

Arrows = dict[str, dict[str, list[str]]]  # room -> room it imports -> ["file:line imports module", ...]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every *.py of the scanned packages (a package is its __init__)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def room_of(module: str, files: dict[str, Path]) -> str:
    """The room of a scanned module (see the module docstring)."""
    parts = module.split(".")
    if parts[0] == "pipelines":
        return "pipelines"
    is_package = files[module].name == "__init__.py"
    if len(parts) == 1 or (len(parts) == 2 and not is_package):
        return module  # mmgen itself, or a module directly in mmgen/
    return ".".join(parts[:2])


def imported_modules(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in the file; `from a import b` gives a.b (resolve() finds a
    when b is a name inside a rather than a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def resolve(name: str, files: dict[str, Path]) -> str | None:
    """The scanned module an imported name lands in (its longest known prefix), or None (not ours)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in files:
            return ".".join(parts)
        parts.pop()
    return None


def _imports(root: Path) -> list[tuple[str, str, str, str, str]]:
    """(module, its room, imported module, its room, "file:line imports module") for every import of ours."""
    files = module_files(root)
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in imported_modules(tree, module, path.name == "__init__.py"):
            target = resolve(name, files)
            if target is not None and target != module:
                where = f"{path.relative_to(root)}:{line} imports {target}"
                found.append((module, room_of(module, files), target, room_of(target, files), where))
    return found


def room_arrows(root: Path) -> Arrows:
    arrows: Arrows = defaultdict(lambda: defaultdict(list))
    for _, source, _, room, where in _imports(root):
        if room != source and where not in arrows[source][room]:
            arrows[source][room].append(where)
    return arrows


def file_arrows(root: Path) -> Arrows:
    """Module -> module it imports, for imports between two files of the same room."""
    arrows: Arrows = defaultdict(lambda: defaultdict(list))
    for module, source, target, room, where in _imports(root):
        if room == source and where not in arrows[module][target]:
            arrows[module][target].append(where)
    return arrows


def circles(arrows: Arrows) -> list[list[str]]:
    """Strongly connected groups of more than one room (Tarjan), each sorted; [] when the graph is a DAG."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(room: str) -> None:
        index[room] = low[room] = len(index)
        stack.append(room)
        for nxt in arrows.get(room, {}):
            if nxt not in index:
                visit(nxt)
                low[room] = min(low[room], low[nxt])
            elif nxt in stack:
                low[room] = min(low[room], index[nxt])
        if low[room] == index[room]:
            group = []
            while not group or group[-1] != room:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for room in sorted(arrows):
        if room not in index:
            visit(room)
    return groups


def describe(group: list[str], arrows: Arrows) -> str:
    lines = [f"import circle between {', '.join(group)}:"]
    for source in group:
        for target in group:
            for where in arrows.get(source, {}).get(target, [])[:3]:
                lines.append(f"  {source} -> {target}: {where}")
    return "\n".join(lines)


def test_no_import_circle_between_rooms():
    arrows = room_arrows(ROOT)
    assert {"pipelines", "mmgen.render", "mmgen.llm", "mmgen.models", "mmgen.loading"} <= set(arrows)
    found = circles(arrows)
    assert not found, "\n".join(describe(group, arrows) for group in found)


def test_no_import_circle_between_files_of_a_room():
    arrows = file_arrows(ROOT)
    assert (
        "mmgen.kernels.flash_attn" in arrows["mmgen.kernels.fa_providers"]
    )  # the scan sees within-room arrows
    found = circles(arrows)
    assert not found, "\n".join(describe(group, arrows) for group in found)


def test_the_runtime_imports_no_product():
    """Only the faces and the executors import pipelines; mmgen.render reaches the tiny detector through
    its cli module alone."""
    arrows = room_arrows(ROOT)
    importers = {room for room, targets in arrows.items() if "pipelines" in targets and room != "pipelines"}
    allowed = {*RUNS_PIPELINES, PRODUCT_INDEX}
    assert importers <= allowed, {room: arrows[room]["pipelines"] for room in importers - allowed}
    tiny = arrows["mmgen.render"].get("mmgen.tiny", [])
    assert all(where.startswith("mmgen/render/cli.py:") for where in tiny), tiny


def test_the_faces_ask_the_family_registry():
    """The faces import the registry and no family's own module; the registry is imported by the faces
    alone (so pipelines, which it imports, never reaches it)."""
    found = [
        where
        for module, room, target, _, where in _imports(ROOT)
        if room in RUNS_PIPELINES and FAMILY_MODULE.match(target) and not module.startswith(PRODUCT_INDEX)
    ]
    assert not found, found
    arrows = room_arrows(ROOT)
    assert PRODUCT_INDEX in arrows["mmgen.cli"] and PRODUCT_INDEX in arrows["mmgen.serve"]
    importers = {room for room, targets in arrows.items() if PRODUCT_INDEX in targets}
    assert importers <= set(RUNS_PIPELINES), {
        room: arrows[room][PRODUCT_INDEX] for room in importers - set(RUNS_PIPELINES)
    }


def test_the_arrows_the_layout_names():
    """Output writers and CLI helpers sit below their users; the LLM's models live in the LLM room."""
    arrows = room_arrows(ROOT)
    assert "pipelines" in arrows["mmgen.render"] and "mmgen.outputs" in arrows["pipelines"]
    assert "mmgen.render" not in arrows["pipelines"] and "mmgen.render" not in arrows["mmgen.default_model"]
    assert "mmgen.llm" not in arrows["mmgen.models"]
    assert "mmgen.cli" not in arrows["mmgen.render"] and "mmgen.cli_args" in arrows["mmgen.render"]
    # The executors sit below both faces; the faces do not import each other.
    assert "mmgen.executors" in arrows["mmgen.render"] and "mmgen.executors" in arrows["mmgen.serve"]
    assert not set(arrows["mmgen.executors"]) & {*FACES, "mmgen.render", "mmgen.serve"}
    assert "mmgen.render" not in arrows["mmgen.serve"], dict(arrows["mmgen.serve"])["mmgen.render"]
    for low in ("mmgen.kernels", "mmgen.outputs", "mmgen.errors"):
        assert not set(arrows.get(low, {})) - {"mmgen.errors"}, (low, dict(arrows[low]))


def test_a_circle_is_found_and_named(tmp_path):
    """The scan itself: a two-room circle through a relative, a lazy and a sub-folder import is reported."""
    files = {
        "mmgen/__init__.py": "",
        "mmgen/errors.py": "",
        "mmgen/a/__init__.py": "",
        "mmgen/a/x.py": "from ..b.deep import y\n",
        "mmgen/b/__init__.py": "",
        "mmgen/b/deep/__init__.py": "",
        "mmgen/b/deep/y.py": "def f():\n    from mmgen.a import x\n",
        "mmgen/c.py": "import mmgen.errors\n",
        "pipelines/__init__.py": "from mmgen import c\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    arrows = room_arrows(tmp_path)
    assert circles(arrows) == [["mmgen.a", "mmgen.b"]]
    assert arrows["mmgen.b"]["mmgen.a"] == ["mmgen/b/deep/y.py:2 imports mmgen.a.x"]
    assert "mmgen/a/x.py:1 imports mmgen.b.deep.y" in describe(["mmgen.a", "mmgen.b"], arrows)
    assert dict(arrows["pipelines"]) == {"mmgen.c": ["pipelines/__init__.py:1 imports mmgen.c"]}
    assert dict(arrows["mmgen.c"]) == {"mmgen.errors": ["mmgen/c.py:1 imports mmgen.errors"]}


def test_a_file_circle_inside_a_room_is_found_and_named(tmp_path):
    """The scan of files: a circle of three modules of one room (one import lazy, one relative) is reported;
    a package importing its own module is an arrow, not a circle."""
    files = {
        "mmgen/__init__.py": "",
        "mmgen/a/__init__.py": "from mmgen.a import x\n",
        "mmgen/a/x.py": "from .y import f\n",
        "mmgen/a/y.py": "def f():\n    from mmgen.a.deep import z\n",
        "mmgen/a/deep/__init__.py": "",
        "mmgen/a/deep/z.py": "import mmgen.a.x\n",
        "mmgen/b.py": "from mmgen.a import x\n",
        "pipelines/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    arrows = file_arrows(tmp_path)
    assert circles(arrows) == [["mmgen.a.deep.z", "mmgen.a.x", "mmgen.a.y"]]
    assert arrows["mmgen.a.y"]["mmgen.a.deep.z"] == ["mmgen/a/y.py:2 imports mmgen.a.deep.z"]
    assert "mmgen/a/x.py:1 imports mmgen.a.y" in describe(
        ["mmgen.a.deep.z", "mmgen.a.x", "mmgen.a.y"], arrows
    )
    assert "mmgen.b" not in arrows and not circles(room_arrows(tmp_path))  # other rooms: room arrows only
