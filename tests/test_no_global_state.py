"""No global forward state in mmgen/ or pipelines/: attention metadata and caches travel as arguments.

The scan (ast, every *.py under mmgen/ and pipelines/) fails on any of:
1. a name, attribute, import or definition `get_forward_context` / `set_forward_context`;
2. `contextvars` imported, or `ContextVar` named anywhere; `threading.local` (thread-global state);
3. a `global` statement;
4. a memoizing decorator, `functools.cache` or `functools.lru_cache` (bare or called): it keeps
   results in process-wide state;
5. a module-level binding (assignment, annotated or augmented, at the top of a module or inside a
   module-level if/try/with/for, not inside a def or class) of a mutable value, unless it is a
   constant table. Mutable values: list/dict/set displays and comprehensions, calls of list, dict,
   set, bytearray, defaultdict, OrderedDict, Counter, deque, ChainMap, WeakValueDictionary,
   WeakKeyDictionary, WeakSet, torch tensor factories (torch.tensor, zeros, empty, arange, ...), and
   tuples holding any of these. A constant table is a NON-EMPTY display, comprehension or
   list/dict/set/bytearray call bound to an ALL_CAPS name (leading underscores allowed) that no
   scanned file mutates: no item assignment or deletion through it, no augmented assignment to it,
   no call of a mutating method on it or on anything reached from it (append, extend, insert,
   update, setdefault, pop, popitem, clear, add, discard, remove, sort, reverse). So always flagged:
   empty containers (they exist to be filled: caches, registries), lowercase names, the fill-me
   collections (defaultdict, Counter, deque, ...), module-level tensors, any mutated table.
   Tuples, frozensets and MappingProxyType(...) are immutable and always pass (the outermost call
   decides: frozenset({...}) passes). The one name exempt is `__all__`, read by tooling only.
6. parallel state looked up instead of passed (the ParallelLayout carries the groups): a name,
   attribute or definition `get_<something>_group` (get_sp_group, get_world_group, torch's
   _get_default_group, ...); a module-level binding of a process group (a call of new_group,
   new_subgroups, init_device_mesh or init_process_group at module level); a torch.distributed
   collective or point-to-point call without an explicit `group=` (it would run on the implicit
   world group, a global).
Objects built by other calls (an instance of some class) are not judged: this is a lint of the
common ways forward state leaks into globals, not a proof of purity.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("mmgen", "pipelines")
CONTEXT_FUNCTIONS = frozenset({"get_forward_context", "set_forward_context"})
CONTAINER_FACTORIES = frozenset({"list", "dict", "set", "bytearray"})
FILL_ME_FACTORIES = frozenset(
    {
        "defaultdict",
        "OrderedDict",
        "Counter",
        "deque",
        "ChainMap",
        "WeakValueDictionary",
        "WeakKeyDictionary",
        "WeakSet",
    }
)
TENSOR_FACTORIES = frozenset(
    {
        "tensor",
        "as_tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "linspace",
        "rand",
        "randn",
        "randint",
    }
)
MEMOIZERS = frozenset({"cache", "lru_cache"})
GROUP_LOOKUP = re.compile(r"^_?get_\w*_group$")
GROUP_FACTORIES = frozenset({"new_group", "new_subgroups", "init_device_mesh", "init_process_group"})
COLLECTIVES = frozenset(
    {"all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single", "broadcast"}
    | {"reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "barrier", "P2POp", "isend", "irecv"}
    | {"send", "recv", "reduce"}
)
MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "update",
        "setdefault",
        "pop",
        "popitem",
        "clear",
        "add",
        "discard",
        "remove",
    }
    | {"sort", "reverse"}
)


def _called_name(node: ast.expr) -> str | None:
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _root_name(node: ast.expr) -> str | None:
    """The name a chain like TABLE["a"].b[0] starts from (or ends in, for module.TABLE)."""
    while isinstance(node, ast.Subscript | ast.Attribute | ast.Call):
        if isinstance(node, ast.Attribute) and node.attr.lstrip("_").isupper():
            return node.attr
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_constant_name(name: str) -> bool:
    return name.lstrip("_").isupper()


def _is_torch_factory(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in TENSOR_FACTORIES
        and isinstance(func.value, ast.Name)
        and func.value.id == "torch"
    )


def _mutable_value(value: ast.expr | None) -> tuple[str, bool] | None:
    """(why the value is mutable, whether it may still be a constant table), or None when immutable."""
    if value is None:
        return None
    if isinstance(value, ast.List | ast.Set):
        return f"a {type(value).__name__.lower()} display", bool(value.elts)
    if isinstance(value, ast.Dict):
        return "a dict display", bool(value.keys)
    if isinstance(value, ast.ListComp | ast.DictComp | ast.SetComp):
        return f"a {type(value).__name__.lower()}", True
    if isinstance(value, ast.Tuple):
        reasons = [r for r in map(_mutable_value, value.elts) if r]
        return (reasons[0][0], all(ok for _, ok in reasons)) if reasons else None
    if isinstance(value, ast.Call):
        name = _called_name(value)
        if _is_torch_factory(value):
            return "a torch tensor", False
        if name in FILL_ME_FACTORIES:
            return f"a {name}() call", False
        if name in CONTAINER_FACTORIES:
            return f"a {name}() call", bool(value.args or value.keywords)
    return None


def _module_level_statements(body: list[ast.stmt]):
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for field in ("body", "orelse", "finalbody"):
            yield from _module_level_statements(getattr(stmt, field, []) or [])
        for handler in getattr(stmt, "handlers", []) or []:
            yield from _module_level_statements(handler.body)


def mutated_names(tree: ast.Module) -> set[str]:
    """Names whose value some statement mutates (item store/delete, augmented assignment, mutating call)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            names.add(_root_name(node.value))
        elif isinstance(node, ast.AugAssign):
            names.add(_root_name(node.target))
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            names.add(_root_name(node.func.value))
    return names - {None}


def _binding_hits(tree: ast.Module, mutated: set[str]) -> list[tuple[int, str]]:
    hits = []
    for stmt in _module_level_statements(tree.body):
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
            targets, value = [stmt.target], stmt.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if names == ["__all__"]:
            continue
        if isinstance(value, ast.Call) and _called_name(value) in GROUP_FACTORIES:
            hits.append((stmt.lineno, f"module-level {', '.join(names) or 'binding'} is a process group"))
            continue
        found = _mutable_value(value)
        if found is None:
            continue
        reason, may_be_constant = found
        constant = may_be_constant and names and all(map(_is_constant_name, names))
        if constant and not isinstance(stmt, ast.AugAssign) and not mutated.intersection(names):
            continue
        hits.append((stmt.lineno, f"module-level {', '.join(names) or 'binding'} is {reason}"))
    return hits


def _is_implicit_group_call(call: ast.Call) -> bool:
    """dist.<collective>(...) / torch.distributed.<collective>(...) with no group= keyword."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr not in COLLECTIVES:
        return False
    owner = func.value
    named_dist = (isinstance(owner, ast.Name) and owner.id == "dist") or (
        isinstance(owner, ast.Attribute) and owner.attr == "distributed"
    )
    return named_dist and not any(keyword.arg == "group" for keyword in call.keywords)


def _node_hits(tree: ast.Module) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Global):
            hits.append((line, f"global statement ({', '.join(node.names)})"))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = {alias.name for alias in node.names}
            module = getattr(node, "module", None) or ""
            if "contextvars" in names or module == "contextvars":
                hits.append((line, "imports contextvars"))
            if module == "threading" and "local" in names:
                hits.append((line, "imports threading.local"))
            if names & CONTEXT_FUNCTIONS:
                hits.append((line, f"imports {sorted(names & CONTEXT_FUNCTIONS)}"))
        elif isinstance(node, ast.Name | ast.Attribute):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in CONTEXT_FUNCTIONS or name == "ContextVar":
                hits.append((line, f"uses {name}"))
            if GROUP_LOOKUP.match(name):
                hits.append((line, f"looks a process group up with {name} (pass the ParallelLayout)"))
            if (
                isinstance(node, ast.Attribute)
                and name == "local"
                and _called_name(node.value) == "threading"
            ):
                hits.append((line, "uses threading.local"))
        elif isinstance(node, ast.Call) and _is_implicit_group_call(node):
            hits.append((line, f"{_called_name(node)} without group= runs on the implicit world group"))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if GROUP_LOOKUP.match(node.name):
                hits.append((line, f"defines {node.name} (process groups travel in the ParallelLayout)"))
            if node.name in CONTEXT_FUNCTIONS:
                hits.append((line, f"defines {node.name}"))
            for decorator in node.decorator_list:
                if _called_name(decorator) in MEMOIZERS:
                    hits.append((line, f"{node.name} is memoized with {_called_name(decorator)}"))
    return hits


def global_state_hits(sources: dict[str, str]) -> list[str]:
    """Every rule violation in a set of modules {filename: source}, as 'file:line: reason'."""
    trees = {name: ast.parse(source, filename=name) for name, source in sources.items()}
    mutated = set().union(*map(mutated_names, trees.values()))
    hits = []
    for name, tree in trees.items():
        found = sorted(_node_hits(tree) + _binding_hits(tree, mutated))
        hits += [f"{name}:{line}: {why}" for line, why in found]
    return hits


def scanned_files() -> list[Path]:
    return sorted(p for top in SCANNED for p in (ROOT / top).rglob("*.py"))


def test_tree_has_no_global_forward_state():
    files = scanned_files()
    assert any(p.name == "wan.py" for p in files), "the scan found none of mmgen's sources"
    hits = global_state_hits({str(path.relative_to(ROOT)): path.read_text() for path in files})
    assert not hits, "global state found:\n" + "\n".join(hits)


@pytest.mark.parametrize(
    "source",
    [
        "from mmgen.context import get_forward_context\n",
        "def f():\n    return ctx.get_forward_context().attn\n",
        "def set_forward_context(x):\n    pass\n",
        "import contextvars\n",
        "from contextvars import ContextVar\n",
        "VAR = contextvars.ContextVar('x')\n",
        "def f():\n    global STATE\n    STATE = 1\n",
        "_CACHE = {}\n",
        "_cache = {'a': 1}\n",
        "TABLE = {'a': 1}\nTABLE['b'] = 2\n",
        "NAMES = ['a']\n\ndef f():\n    NAMES.append('b')\n",
        "CONFIG = {'a': [1]}\n\ndef f():\n    CONFIG['a'].append(2)\n",
        "HANDLERS = dict()\n",
        "REGISTRY: dict[str, int] = {}\n",
        "SEEN = set()\n",
        "items = [x for x in range(3)]\n",
        "if True:\n    TABLE = collections.defaultdict(list)\n",
        "try:\n    import x\nexcept ImportError:\n    FALLBACKS = []\n",
        "PAIR = ({}, 1)\n",
        "POSITIONS = torch.arange(16)\n",
        "X += [1]\n",
        "@functools.lru_cache(maxsize=None)\ndef f(x):\n    return x\n",
        "@cache\ndef f(x):\n    return x\n",
        "LOCAL = threading.local()\n",
        "def get_sp_group():\n    return _GROUPS['sp']\n",
        "def f(x):\n    dist.all_reduce(x, group=parallel_state.get_sp_group())\n",
        "SP_GROUP = dist.new_group([0, 1])\n",
        "if True:\n    MESH = init_device_mesh('cuda', (2,))\n",
        "def f(x):\n    dist.all_gather(parts, x)\n",
        "def f(x):\n    torch.distributed.all_to_all_single(out, x)\n",
        "def f():\n    return dist.distributed_c10d._get_default_group()\n",
    ],
)
def test_rule_flags(source):
    assert global_state_hits({"m.py": source})


@pytest.mark.parametrize(
    "source",
    [
        "__all__ = ['a', 'b']\n",
        "NAMES = ('a', 'b')\n",
        "DEFAULTS = {'eps': 1e-6, 'dims': [1, 2]}\n",
        "_KEY_MAP = {'a': 'b'}\n\ndef f(key):\n    return _KEY_MAP.get(key)\n",
        "TABLE = {'a': 1}\n\ndef f():\n    table = dict(TABLE)\n    table['b'] = 2\n",
        "ALLOWED = frozenset({'a', 'b'})\n",
        "TABLE = types.MappingProxyType({'a': 1})\n",
        "SCALE = 2.0\nNAME = 'x'\n",
        "def f():\n    cache = {}\n    return cache\n",
        "class A:\n    def f(self):\n        self.items = []\n",
        "@dataclass(frozen=True)\nclass A:\n    x: tuple = ()\n",
        "DTYPE = torch.float32\n",
        "def f(x, layout):\n    dist.all_gather(parts, x, group=layout.sp_group)\n",
        "def f(layout):\n    return dist.new_group([0, 1])\n",
        "def f(group):\n    return dist.get_global_rank(group, 0)\n",
    ],
)
def test_rule_allows(source):
    assert global_state_hits({"m.py": source}) == []


def test_a_table_mutated_from_another_module_is_flagged():
    sources = {"a.py": "TABLE = {'x': 1}\n", "b.py": "from a import TABLE\n\ndef f():\n    TABLE['y'] = 2\n"}
    assert global_state_hits(sources) == ["a.py:1: module-level TABLE is a dict display"]
