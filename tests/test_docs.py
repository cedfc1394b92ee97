"""The README and docs/: the generated configuration page is current, the README stays short,
every relative link points at a file (and heading) that exists, and no "session N" / "issue N"
wording (which means nothing to a reader) appears in them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
import re

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
MAX_README_LINES = 200

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_DIARY = re.compile(r"\b(session|issue)s?\s+#?\d+", re.I)


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prose(path: Path) -> str:
    """The page without its fenced code blocks (a mermaid diagram, shell commands)."""
    return _FENCE.sub("", path.read_text())


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a page: lower case, punctuation dropped, spaces to dashes."""
    out = set()
    for line in _prose(path).splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            out.add(text.replace(" ", "-"))
    return out


def test_configuration_md_is_generated_from_the_source():
    gen = _gen_docs()
    current = gen.OUT.read_text() if gen.OUT.exists() else ""
    assert current == gen.render(), (
        "docs/configuration.md is not what engine/config.py, entrypoints/args.py and "
        f"engine/envs.py give: run `{gen.COMMAND}` and commit the result")


def test_every_config_field_and_variable_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    gen = _gen_docs()
    for field in gen.config_fields():
        assert f"| `{field.name}` |" in text
    import engine.envs as envs
    for var in envs.VARIABLES:
        assert f"| `{var.name}` |" in text


def test_config_comments_are_read_as_docs():
    gen = _gen_docs()
    src = '''
class EngineConfig:
    a: int = 1  # beside a
    # above b,
    # two lines
    b: int = 2
    c: str = "x"
    d: bool = True  # beside d
    e: int = 4
    #: above f
    f: Optional[int] = 4 * 1024
'''
    fields = {f.name: f for f in gen.config_fields(src)}
    assert fields["a"].doc == "beside a" and fields["b"].doc == "above b, two lines"
    assert fields["c"].doc == "" and fields["c"].shared_with == "b"
    assert fields["d"].shared_with is None and fields["e"].shared_with is None
    assert fields["f"].doc == "above f" and fields["f"].default == "4 * 1024 (= 4,096)"
    assert fields["f"].type == "Optional[int]"


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_that_exist(page: Path):
    broken = []
    for m in _LINK.finditer(_prose(page)):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_session_or_issue_numbers(page: Path):
    hits = [m.group(0) for m in _DIARY.finditer(page.read_text())]
    assert not hits, (f"{page.relative_to(ROOT)} says {hits}: say what the thing does "
                      "(dates and commits belong in bench/RESULTS.md)")


def test_every_module_has_its_sentence_in_structures_md():
    """docs/structures.md names every module of the product packages (a new module gets its
    one sentence there)."""
    text = (ROOT / "docs" / "structures.md").read_text()
    named = set(re.findall(r"`(?:[\w./]*/)?(\w+\.py)`", text))
    missing = [str(p.relative_to(ROOT)) for package in ("engine", "ipc", "entrypoints", "states")
               for p in sorted((ROOT / package).rglob("*.py"))
               if p.name != "__init__.py" and p.name not in named]
    assert missing == []
