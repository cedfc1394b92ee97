"""No code path of the engine may deserialize with pickle or evaluate strings.

Pickle over the engine's sockets is how vLLM got CVE-2025-32444 (CVSS 10.0) and friends. The
check parses the source with ``ast``, so comments, docstrings and strings do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "states", "ipc")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "marshal", "dill", "shelve", "joblib"}
BANNED_CALLS = {"eval", "exec"}


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert files, "no sources found"
    return files


def _top(name: str | None) -> str:
    return (name or "").split(".")[0]


def _const_str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _kwarg(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def violations(source: str, filename: str = "<src>") -> list[str]:
    """Every banned import or call in ``source``, as "file:line: what"."""
    out: list[str] = []
    tree = ast.parse(source, filename=filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _top(alias.name) in BANNED_MODULES:
                    out.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and _top(node.module) in BANNED_MODULES:
                out.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in BANNED_CALLS or name in {f"builtins.{c}" for c in BANNED_CALLS}:
                out.append(f"{where}: {name}(...)")
            elif name in {"__import__", "importlib.import_module", "import_module"} and node.args:
                mod = _const_str(node.args[0])
                if mod is None or _top(mod) in BANNED_MODULES:
                    out.append(f"{where}: {name}({mod!r})")
            elif name == "torch.load":
                wo = _kwarg(node, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    out.append(f"{where}: torch.load without weights_only=True (unpickles)")
            elif name in {"np.load", "numpy.load"}:
                ap = _kwarg(node, "allow_pickle")
                if ap is not None and not (isinstance(ap, ast.Constant) and ap.value is False):
                    out.append(f"{where}: {name}(allow_pickle=...)")
    return out


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pickle_marshal_eval_exec(path: Path):
    found = violations(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "banned deserialization/evaluation:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "src",
    [
        "import pickle",
        "import cloudpickle as cp",
        "from pickle import loads",
        "from marshal import loads",
        "import dill.settings",
        "import os, _pickle",
        "eval('1')",
        "exec(code)",
        "builtins.eval(x)",
        "__import__('pickle')",
        "importlib.import_module('marshal')",
        "importlib.import_module(name)",
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
        "np.load(f, allow_pickle=True)",
        "def f():\n    import pickle",
    ],
)
def test_checker_catches(src):
    assert violations(src)


@pytest.mark.parametrize(
    "src",
    [
        "# import pickle\nx = 1",
        "'''eval(x) and import pickle'''",
        "s = 'exec(code)'",
        "obj.exec(q)",                       # a method named exec is not the builtin
        "model.eval()",                      # torch's Module.eval()
        "torch.load(f, weights_only=True)",
        "np.load(f)",
        "from .pickle_free import x",       # relative import of a local module
        "import msgspec",
    ],
)
def test_checker_allows(src):
    assert not violations(src)
