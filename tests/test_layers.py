"""The layers and the module graph: states <- engine <- ipc <- entrypoints, and no import circles.

Imports are read with ``ast`` from the source -- every ``import`` / ``from ... import``, also
inside functions and under ``if TYPE_CHECKING`` -- so a circle hidden in a function body counts
too. ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of
``pkg`` (its ``__init__``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("states", "engine", "ipc", "entrypoints")
#: What each package may import from the others.
ALLOWED = {
    "states": set(),
    "engine": {"states"},
    "ipc": {"states", "engine"},
    "entrypoints": {"states", "engine", "ipc"},
}
#: Circles known to exist, owned by another branch (each a sorted tuple of its modules). An entry
#: that no longer matches a circle fails the test, so the list can only shrink.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    mods = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    assert len(mods) > 20, "sources not found"
    return mods


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The project modules ``name`` imports (anywhere in its source)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = ".".join(base[: len(base) - node.level + 1])
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            for alias in node.names:
                full = f"{mod}.{alias.name}"
                add(full if full in modules else mod)
    return out


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    names = set(mods)
    return {name: imports_of(name, path, names) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(tuple(sorted(comp)))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def _is_package_init_edge(a: str, b: str) -> bool:
    # A package's __init__ re-exports its modules, and Python runs it before any of them: an
    # edge from a module up to its own package's __init__ is how imports work, not a circle of
    # ours -- leave such edges out.
    return a.startswith(b + ".")


def project_cycles() -> list[tuple[str, ...]]:
    g = {a: {b for b in bs if not _is_package_init_edge(a, b)} for a, bs in graph().items()}
    return cycles(g)


def test_layers_import_only_downwards():
    bad = []
    for mod, targets in graph().items():
        pkg = mod.split(".")[0]
        for t in targets:
            other = t.split(".")[0]
            if other != pkg and other not in ALLOWED[pkg]:
                bad.append(f"{mod} imports {t}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    found = set(project_cycles())
    assert found - KNOWN_CYCLES == set(), f"new import circles: {sorted(found - KNOWN_CYCLES)}"
    assert KNOWN_CYCLES - found == set(), f"fixed, remove from KNOWN_CYCLES: {sorted(KNOWN_CYCLES - found)}"


@pytest.mark.parametrize("source,expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [("a", "b", "c")]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_cycle_finder_finds_circles(source, expected):
    assert cycles(source) == expected


def test_function_local_and_relative_imports_count(tmp_path):
    mods = {"pkg", "pkg.a", "pkg.b"}
    src = tmp_path / "a.py"
    src.write_text("def f():\n    from .b import thing\n    from pkg import b\n")
    assert imports_of("pkg.a", src, mods) == {"pkg.b"}
