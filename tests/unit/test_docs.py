"""The documentation stays true to the repository: the README is a short guide (at most 200
lines); no document links outside the repository; every result file under
``benchmarks/results/`` and every ``bootstrap/....py`` module a document cites exists; every
relative markdown link (and its ``#anchor``) resolves; ``docs/design.md``'s layering table is
the one ``tests/unit/test_layout.py`` checks; no module docstring of ``bootstrap/`` runs over 15
lines. Reads files only: no torch, no imports of the package. Run alone:
``python -m pytest -q tests/unit/test_docs.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = [README, *DOCS, BENCHMARKS]
MAX_README_LINES = 200
PACKAGE = ROOT / "bootstrap"
MAX_MODULE_DOCSTRING_LINES = 15  # what the module is for and its contract; a mechanism is explained once, by its owner

FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
UP_PATH = re.compile(r"(?<![\w.])((?:\.\./)+[\w.\-/]*)")
RESULT = re.compile(r"(?<![\w/])(benchmarks/results/[\w.*\-/]+)")
RELATIVE_RESULT = re.compile(r"(?<![\w/.])(results/[\w.*\-/]+)")  # benchmarks/README.md cites ``results/...``
MODULE = re.compile(r"(?<![\w/])(bootstrap/[\w*\-/]+\.py)\b")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*$", re.MULTILINE)


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


def text_of(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def cited(pattern: re.Pattern[str], text: str) -> set[str]:
    return {m.rstrip(".,:;") for m in pattern.findall(text)}


def exists(base: Path, citation: str) -> bool:
    """A path, or a glob pattern that matches at least one file."""
    if "*" in citation:
        return any(base.glob(citation))
    return (base / citation).exists()


def slug(heading: str) -> str:
    """A GitHub heading anchor: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(h) for h in HEADING.findall(FENCE.sub("", text_of(path)))}


def test_the_documents_are_there():
    assert README.is_file() and BENCHMARKS.is_file()
    assert {p.name for p in DOCS} >= {
        "design.md",
        "stages.md",
        "memory.md",
        "cuda-graphs.md",
        "serving.md",
        "tensor-parallel.md",
        "trtllm.md",
    }


def test_readme_is_at_most_200_lines():
    lines = text_of(README).splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_nothing_points_outside_the_repository(path: Path):
    text = text_of(path)
    assert "../shared" not in text
    outside = []
    for target in [*cited(UP_PATH, text), *(t for t in LINK.findall(text) if "://" not in t)]:
        resolved = (path.parent / target.split("#")[0]).resolve()
        if not resolved.is_relative_to(ROOT):
            outside.append(target)
    assert outside == []


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_every_cited_result_file_exists(path: Path):
    text = text_of(path)
    missing = [c for c in cited(RESULT, text) if not exists(ROOT, c)]
    if path == BENCHMARKS:
        missing += [c for c in cited(RELATIVE_RESULT, text) if not exists(BENCHMARKS.parent, c)]
    assert missing == []


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_every_cited_module_exists(path: Path):
    missing = [c for c in cited(MODULE, text_of(path)) if not exists(ROOT, c)]
    assert missing == []


@pytest.mark.parametrize("path", FILES, ids=ids(FILES))
def test_every_relative_link_resolves(path: Path):
    broken = []
    for target in LINK.findall(FENCE.sub("", text_of(path))):
        if "://" in target or target.startswith("mailto:"):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    assert broken == []


def layout_table() -> dict[str, set[str]]:
    """``ALLOWED`` of ``tests/unit/test_layout.py``, read as data (the module is not imported)."""
    tree = ast.parse(text_of(ROOT / "tests" / "unit" / "test_layout.py"))
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ALLOWED":
            value = node.value
            return {
                ast.literal_eval(k): {ast.literal_eval(e) for e in v.elts} if isinstance(v, ast.Set) else set()
                for k, v in zip(value.keys, value.values)
            }
    raise AssertionError("tests/unit/test_layout.py defines no ALLOWED table")


def test_design_holds_the_layering_table():
    rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \|", text_of(ROOT / "docs" / "design.md"), re.MULTILINE)
    documented = {room: {r.strip() for r in allowed.split(",")} - {"(nothing)"} for room, allowed in rows}
    assert documented == layout_table()


def test_the_checks_see_what_they_check():
    """Break-check of the patterns: a stale path, an outside link and a missing result are seen."""
    sample = "see [x](../../shared/DESIGN.md), `bootstrap/runner.py` and benchmarks/results/gone.json."
    assert cited(MODULE, sample) == {"bootstrap/runner.py"}
    assert cited(RESULT, sample) == {"benchmarks/results/gone.json"}
    assert LINK.findall(sample) == ["../../shared/DESIGN.md"]
    assert not (README.parent / "../../shared/DESIGN.md").resolve().is_relative_to(ROOT)
    assert slug("The budget split (`split.py`)") == "the-budget-split-splitpy"


def module_docstring_lines(source: str) -> int:
    """How many lines a module's docstring spans as written (0 for a module without one)."""
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        assert first.end_lineno is not None
        return first.end_lineno - first.lineno + 1
    return 0


def test_every_module_docstring_is_at_most_15_lines():
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := module_docstring_lines(text_of(path))) > MAX_MODULE_DOCSTRING_LINES
    }
    assert too_long == {}, f"module docstrings over {MAX_MODULE_DOCSTRING_LINES} lines: shorten them"


def test_the_docstring_check_sees_a_long_docstring():
    """Break-check of the counter: a 17-line docstring is seen as one, a one-liner and none too."""
    assert module_docstring_lines('"""First line.\n' + "more\n" * 15 + '"""\n\nx = 1\n') == 17
    assert module_docstring_lines('"""One line."""\n') == 1
    assert module_docstring_lines("# a comment\nx = 1\n") == 0
    assert module_docstring_lines("") == 0
