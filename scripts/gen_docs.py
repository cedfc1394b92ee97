"""Generate docs/configuration.md from the source: every ``EngineConfig`` field and every
environment variable of ``engine/envs.py``.

    python scripts/gen_docs.py          # rewrite docs/configuration.md
    python scripts/gen_docs.py --check  # exit 1 if docs/configuration.md is not what it would write

A field's doc is the comment block right above it in engine/config.py plus the comment beside it;
a field without its own comment that directly follows a field documented by a block above it
shares that block (e.g. the tensor-parallel fields). The command-line flag of a field is read from
the ``EngineConfig(...)`` call in entrypoints/args.py. Nothing here imports torch: the config is
read with ``ast`` and ``tokenize``; ``engine.envs`` imports only the standard library.
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "engine" / "config.py"
ARGS = ROOT / "entrypoints" / "args.py"
OUT = ROOT / "docs" / "configuration.md"
COMMAND = "python scripts/gen_docs.py"


class Field(NamedTuple):
    name: str
    type: str
    default: str
    doc: str
    shared_with: Optional[str]  # the field whose block comment this one shares


def _comments(source: str) -> dict[int, str]:
    """line -> the text of the comment on it (without ``#``/``#:`` and the space after)."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string[1:]
            text = text[1:] if text.startswith(":") else text
            out[tok.start[0]] = text.strip()
    return out


def _default(node: Optional[ast.expr]) -> str:
    if node is None:
        return "(required)"
    text = ast.unparse(node)
    if isinstance(node, ast.BinOp):  # 4 * 1024 * 1024: show the number too
        try:
            value = eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})
        except Exception:  # noqa: BLE001 -- not a constant expression: the text alone
            return text
        return f"{text} (= {value:,})"
    return text


def config_fields(source: Optional[str] = None, class_name: str = "EngineConfig") -> list[Field]:
    """The fields of ``class_name`` in engine/config.py, in order, with their comments."""
    source = CONFIG.read_text() if source is None else source
    lines = source.splitlines()
    comments = _comments(source)
    tree = ast.parse(source)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls is None:
        raise SystemExit(f"{CONFIG}: no class {class_name}")
    fields: list[Field] = []
    leader: Optional[str] = None  # the field the current block comment documents
    prev_end = cls.body[0].lineno - 1 if cls.body else cls.lineno
    for node in cls.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            prev_end = node.end_lineno or node.lineno
            leader = None
            continue
        start, end = node.lineno, node.end_lineno or node.lineno
        block: list[str] = []
        line = start - 1
        while line > prev_end and lines[line - 1].strip().startswith("#"):
            block.insert(0, comments.get(line, ""))
            line -= 1
        beside = [comments[i] for i in range(start, end + 1) if i in comments]
        adjacent = start - 1 == prev_end  # no blank line, no comment between the two
        shared = None
        if block:
            leader = node.target.id
        elif not beside and leader is not None and adjacent:
            shared = leader
        else:
            leader = None
        doc = " ".join(p for p in block + beside if p)
        fields.append(Field(node.target.id, ast.unparse(node.annotation), _default(node.value),
                            doc, shared))
        prev_end = end
    return fields


def cli_flags(source: Optional[str] = None) -> dict[str, str]:
    """field -> its command-line flag, from ``EngineConfig(field=a.dest, ...)`` and the
    ``add_argument`` calls of entrypoints/args.py."""
    source = ARGS.read_text() if source is None else source
    tree = ast.parse(source)
    dest_flag: dict[str, str] = {}
    field_dest: dict[str, str] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "add_argument":
            flags = [a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            long = [f for f in flags if f.startswith("--")]
            if not long:
                continue
            dest = next((k.value.value for k in node.keywords
                         if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
            optional = any(k.arg == "action" and ast.unparse(k.value).endswith("BooleanOptionalAction")
                           for k in node.keywords)
            flag = f"--[no-]{long[0][2:]}" if optional else long[0]
            dest_flag[dest or long[0][2:].replace("-", "_")] = flag
        elif isinstance(func, ast.Name) and func.id == "EngineConfig":
            for k in node.keywords:
                if k.arg and isinstance(k.value, ast.Attribute):
                    field_dest[k.arg] = k.value.attr
    out = {}
    for field, dest in field_dest.items():
        if dest in dest_flag:  # a store_false flag (--no-prefix-caching) sets the field False
            out[field] = dest_flag[dest]
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    sys.path.insert(0, str(ROOT))
    from engine import envs  # noqa: E402 -- the standard library only

    fields = config_fields()
    flags = cli_flags()
    out = [
        "# Configuration",
        "",
        f"<!-- Generated by `{COMMAND}` from engine/config.py, entrypoints/args.py and",
        f"     engine/envs.py; do not edit by hand (tests/test_docs.py checks it is current). -->",
        "",
        "Everything a user chooses is a field of `engine.config.EngineConfig`, a msgspec Struct:",
        "",
        "- in process: `AsyncEngine.open(EngineConfig(model=..., max_num_seqs=...))`;",
        "- on the command line: the flag beside the field (`enginecore serve`, `enginecore generate`),",
        "  or the whole config as JSON with `--config-json '{\"model\": ...}'` (it overrides the flags);",
        "- over IPC: `EngineClient.spawn(EngineConfig(...))` passes it to the child as JSON.",
        "",
        "Unknown fields are refused; `EngineConfig.validate()` checks the ranges when an engine is",
        "built. The serving process's own flags (listen address, token, drain timeout, HTTP limits,",
        "logging) are in [serving.md](serving.md).",
        "",
        "## EngineConfig",
        "",
        "| field | type | default | flag | what |",
        "|---|---|---|---|---|",
    ]
    for f in fields:
        doc = f.doc or (f"See `{f.shared_with}`." if f.shared_with else "")
        flag = f"`{flags[f.name]}`" if f.name in flags else ""
        out.append(f"| `{f.name}` | `{_cell(f.type)}` | `{_cell(f.default)}` | {flag} | "
                   f"{_cell(doc)} |")
    out += [
        "",
        "## Environment variables",
        "",
        "The environment keeps only what must not travel in a config or on a command line",
        "(secrets) and kill switches (`0` turns one of the engine's own kernels or helpers off on a",
        "machine where it misbehaves). They are declared in `engine/envs.py` and read when an",
        "engine, a worker or a frontend is built, never at import. No other `ENGINECORE_*`",
        "variable is read.",
        "",
        "| variable | default | kind | what |",
        "|---|---|---|---|",
    ]
    for v in envs.VARIABLES:
        default = f"`{v.default}`" if v.default else "(unset)"
        out.append(f"| `{v.name}` | {default} | {v.kind} | {_cell(v.doc)} |")
    out.append("")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if docs/configuration.md differs from what would be written")
    a = ap.parse_args(argv)
    text = render()
    if a.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is not current: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
