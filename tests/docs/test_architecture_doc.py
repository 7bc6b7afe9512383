"""docs/architecture.md names only what exists.

* every path it writes in an inline code span that ends in ``.py``, ``.md``, ``.json`` or ``/``,
  and every ``.py`` path in a fenced block, exists, relative to the repository root or to
  ``opacus_dp/`` (the page's convention);
* every ``file.py::Name`` is defined in that file (``class``, ``def`` or an assignment at the
  start of a line), and every ``file.py::Class.member`` inside that class's block — a grep-level
  reading of the source text, no import;
* every package of ``opacus_dp`` appears in it (as ``name/``), and README.md links to it.
"""

import re
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "opacus_dp"
DOC = ROOT / "docs" / "architecture.md"

FENCED = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
PATH_SPAN = re.compile(r"^([\w./-]+(?:\.py|\.md|\.json|/))(?:::([\w.]+))?$")
PATH_IN_BLOCK = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")


def _resolved(path: str) -> Path:
    """``path`` under the repository root if it is there, else under ``opacus_dp/``."""
    for base in (ROOT, PACKAGE):
        candidate = base / path
        if candidate.exists():
            return candidate
    return ROOT / path


def named_paths(text: str) -> List[str]:
    """The paths that ``text`` names (module doc), each with its ``::symbol`` if any."""
    names = [m.group(1) for block in FENCED.findall(text) for m in PATH_IN_BLOCK.finditer(block)]
    for span in SPAN.findall(FENCED.sub("", text)):
        if PATH_SPAN.match(span.strip()):
            names.append(span.strip())
    return names


def _definition(name: str) -> re.Pattern:
    return re.compile(rf"^[ \t]*(?:(?:async[ \t]+)?def|class)[ \t]+{re.escape(name)}\b"
                      rf"|^[ \t]*{re.escape(name)}[ \t]*(?::[^=\n]*)?=", re.M)


def _class_block(source: str, name: str) -> str:
    """The lines of top-level class ``name`` (up to the next line that starts in column 0)."""
    match = re.search(rf"^class[ \t]+{re.escape(name)}\b.*$", source, re.M)
    if match is None:
        return ""
    rest = source[match.end():]
    end = re.search(r"^\S", rest, re.M)
    return rest if end is None else rest[:end.start()]


def missing_symbol(source: str, symbol: str) -> bool:
    """Whether ``symbol`` (``Name`` or ``Class.member``) is not defined in ``source``."""
    head, _, member = symbol.partition(".")
    if not _definition(head).search(source):
        return True
    return bool(member) and not _definition(member).search(_class_block(source, head))


def problems(text: str) -> List[str]:
    """What ``text`` names that does not exist."""
    found = []
    for name in named_paths(text):
        match = PATH_SPAN.match(name)
        path, symbol = match.group(1), match.group(2)
        file = _resolved(path)
        if not file.exists():
            found.append(f"{path}: no such file or directory")
        elif symbol and missing_symbol(file.read_text(encoding="utf-8"), symbol):
            found.append(f"{path}::{symbol}: not defined in {file.relative_to(ROOT)}")
    return found


@pytest.fixture(scope="module")
def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def test_every_named_path_and_symbol_exists(doc_text):
    assert len(named_paths(doc_text)) >= 60, "the page's paths were not found (parser broken?)"
    found = problems(doc_text)
    assert not found, "docs/architecture.md names what does not exist:\n" + "\n".join(found)


def test_the_check_catches_a_missing_path_symbol_and_member():
    text = ("`optim/no_such_stage.py` and `optim/clipping.py::NoSuchClipper`, "
            "`optim/clipping.py::Clipper.no_such_capability`, `no_such_package/`\n"
            "```text\n  gather   optim/no_such_source.py\n```\n")
    assert len(problems(text)) == 5
    text = ("`optim/clipping.py::Clipper.per_tensor`, `engine/plan.py::CLIPPING_OPTIONS`, "
            "`accountants/registry.py::_ACCOUNTANTS`, `tests/docs/`, `maths/`")
    assert problems(text) == []


def test_a_member_is_looked_for_in_its_own_class_only():
    source = "class A:\n    def run(self):\n        pass\n\n\nclass B:\n    size = 1\n"
    assert not missing_symbol(source, "A.run") and not missing_symbol(source, "B.size")
    assert missing_symbol(source, "A.size") and missing_symbol(source, "B.run")


def test_every_package_is_in_the_layout(doc_text):
    packages = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    absent = [name for name in packages if f"`{name}/`" not in doc_text]
    assert not absent, f"docs/architecture.md does not place the packages {absent}"


def test_the_readme_links_the_page():
    assert "(docs/architecture.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
