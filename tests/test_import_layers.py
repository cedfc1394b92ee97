"""The import direction between the project's packages, checked from the source.

The top-level layers read ``states`` <- ``engine`` <- ``ipc`` <- ``entrypoints``; inside
``engine/`` each subpackage (and each top-level module) has a floor in ``ENGINE_LAYERS`` and may
import only from its own floor or the floors below it. Lazy imports inside functions count too:
an upward import is a cycle waiting for its first caller. ``TYPE_CHECKING`` blocks are skipped
(they never run). Also here: no module over ``MAX_LINES`` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP_LAYERS = ["states", "engine", "ipc", "entrypoints"]
#: engine's floors, lowest first: a unit imports only from its own floor or lower ones.
ENGINE_LAYERS: list[set[str]] = [
    {"errors", "envs"},
    {"ops"},
    {"structured"},
    {"params", "config", "request", "interface", "ipc_handles"},
    {"model"},
    {"memory", "weight_transfer", "weight_ipc"},
    {"loader"},
    {"kv", "sample"},
    {"forward"},
    {"tp"},
    {"spec_decode"},
    {"runner"},
    {"core"},
    {"serving", "testing"},
    {"__init__"},
]
MAX_LINES = 400


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts
    return ".".join(parts)


def _sources() -> list[Path]:
    return [p for pkg in TOP_LAYERS for p in sorted((ROOT / pkg).rglob("*.py"))]


def _is_module(dotted: str) -> bool:
    path = ROOT / Path(*dotted.split("."))
    return path.is_dir() or path.with_suffix(".py").is_file()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path``, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_lines(tree)
    me = _module(path).split(".")
    package = me if path.name == "__init__.py" else me[:-1]
    out = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            # ``from engine import envs`` imports the module engine.envs (and engine's
            # __init__, which every engine module shares: not counted as an edge)
            modules = [f"{name}.{a.name}" for a in node.names if _is_module(f"{name}.{a.name}")]
            out += [(node.lineno, m) for m in modules]
            if len(modules) < len(node.names):
                out.append((node.lineno, name))
    return out


def _engine_unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(unit: str) -> int:
    for i, units in enumerate(ENGINE_LAYERS):
        if unit in units:
            return i
    raise AssertionError(f"engine.{unit} has no floor in ENGINE_LAYERS: give it one")


def upward_imports() -> list[str]:
    bad = []
    for path in _sources():
        me = _module(path)
        my_top = TOP_LAYERS.index(me.split(".")[0])
        for line, target in imports(path):
            top = target.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{line}: imports {target}"
            if top in TOP_LAYERS and TOP_LAYERS.index(top) > my_top:
                bad.append(where)
            elif top == "engine" and me.split(".")[0] == "engine":
                mine, theirs = _engine_unit(me), _engine_unit(target)
                if mine != theirs and _floor(theirs) > _floor(mine):
                    bad.append(f"{where} (floor {_floor(theirs)} above {_floor(mine)})")
    return bad


def test_every_engine_unit_has_a_floor():
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "engine").iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").exists()}
    for unit in units:
        _floor(unit)


def test_no_upward_imports():
    assert upward_imports() == []


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    mods = {_module(p) for p in _sources()}
    for path in _sources():
        deps = set()
        for _, target in imports(path):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != _module(path):
                deps.add(target)
        graph[_module(path)] = deps
    # a package's __init__ importing its own modules is not a cycle worth a name
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


@pytest.mark.parametrize("package", TOP_LAYERS)
def test_no_module_over_the_limit(package):
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / package).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert long == []
