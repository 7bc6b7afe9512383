"""The modules at Opacus's import paths only re-export.

The paths are read from the table of ``docs/compatibility.md`` (first column; ``.x`` entries are
sub-modules of the row's first path, ``a.{b,c}`` expands to ``a.b`` and ``a.c``). Each such
module, and every module of ``opacus_dp/optimizers/`` and ``opacus_dp/utils/``, may hold only a
docstring, imports, ``__all__``, plain aliases ``Name = other_name`` and the line
``__getattr__ = submodule_getattr(__name__)``; the classes and functions live in their real
homes (``opacus_dp.compat`` and the concept packages). Each module imports, every name of its
``__all__`` is there, and every name the table documents for a row is exposed by one of the
row's paths.
"""

import ast
import builtins
import importlib
import importlib.util
import pathlib
import re

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPOSITORY / "opacus_dp"
TABLE_HEADER = "| Path | What it provides"
DOCUMENTED_NAME = re.compile(r"([A-Za-z_]\w*)(?:\([a-z_]*\))?")


def _cells(line: str):
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _paths(cell: str):
    """The dotted paths of a first-column cell, with ``.x`` and ``{a,b}`` expanded."""
    paths = []
    for code in re.findall(r"`([^`]+)`", cell):
        braces = re.fullmatch(r"([\w.]+)\.\{([\w,]+)\}", code)
        if braces:
            paths += [f"{braces.group(1)}.{name}" for name in braces.group(2).split(",")]
        elif code.startswith("."):
            paths.append(paths[0] + code)
        else:
            paths.append(code)
    return paths


def table_rows():
    """``(paths, documented names)`` of each row of the compatibility table."""
    text = (REPOSITORY / "docs" / "compatibility.md").read_text()
    lines = text[text.index(TABLE_HEADER):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        first, provides = _cells(line)[:2]
        names = [m.group(1) for code in re.findall(r"`([^`]+)`", provides)
                 if (m := DOCUMENTED_NAME.fullmatch(code)) and not hasattr(builtins, m.group(1))]
        rows.append((_paths(first), names))
    return rows


def is_module(path: str) -> bool:
    """True for a module or package; False for a name defined by a package."""
    return importlib.util.find_spec(path) is not None


def source_file(path: str) -> pathlib.Path:
    return pathlib.Path(importlib.util.find_spec(path).origin)


def _module_name(file: pathlib.Path) -> str:
    parts = file.relative_to(REPOSITORY).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def thin_modules():
    documented = {path for paths, _ in table_rows() for path in paths if is_module(path)}
    folders = [file for folder in ("optimizers", "utils") for file in (PACKAGE / folder).glob("*.py")]
    return sorted(documented | {_module_name(file) for file in folders})


def _is_plain_alias(node: ast.Assign) -> bool:
    target, value = node.targets[0], node.value
    if isinstance(target, ast.Name) and target.id == "__all__":
        return isinstance(value, (ast.List, ast.Tuple)) and all(
            isinstance(item, ast.Constant) and isinstance(item.value, str) for item in value.elts)
    if isinstance(target, ast.Name) and target.id == "__getattr__":
        return ast.unparse(value) == "submodule_getattr(__name__)"
    return isinstance(target, ast.Name) and isinstance(value, (ast.Name, ast.Attribute))


def logic_in(source: str):
    """``"<line>: <statement>"`` of each top-level statement that is more than a re-export."""
    found = []
    for position, node in enumerate(ast.parse(source).body):
        docstring = position == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        alias = isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_plain_alias(node)
        if not (docstring or alias or isinstance(node, (ast.Import, ast.ImportFrom))):
            found.append(f"{node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_the_checker_sees_logic():
    assert logic_in('"""Doc."""\nimport os\nfrom a import b as c\n__all__ = ["c"]\nd = c\ne = os.path\n'
                    "__getattr__ = submodule_getattr(__name__)\n") == []
    assert logic_in("def f():\n    pass\nclass A:\n    pass\nx = f()\nif x:\n    pass\n"
                    "__all__ = sorted(['a'])\ny: int = 1\n") == [
        "1: def f():", "3: class A:", "5: x = f()", "6: if x:", "8: __all__ = sorted(['a'])", "9: y: int = 1"]


def test_the_table_is_read():
    rows = dict((paths[0], names) for paths, names in table_rows())
    assert rows["opacus_dp.privacy_analysis"] == ["compute_rdp", "get_privacy_spent"]
    assert "params" in rows["opacus_dp.optimizers.utils"] and "TypeError" not in str(rows)
    modules = thin_modules()
    assert {"opacus_dp.privacy_engine", "opacus_dp.validators.lstm", "opacus_dp.optimizers.perlayeroptimizer",
            "opacus_dp.utils.stats", "opacus_dp.data_loader"} <= set(modules)
    assert "opacus_dp.GradSampleModuleFastGradientClipping" not in modules  # a name, not a module


@pytest.mark.parametrize("module", thin_modules())
def test_compatibility_module_only_re_exports(module):
    found = logic_in(source_file(module).read_text())
    assert not found, (f"{module} defines more than re-exports (move it to opacus_dp.compat or the "
                       "concept package it belongs to):\n" + "\n".join(found))


@pytest.mark.parametrize("module", thin_modules())
def test_compatibility_module_exposes_its_all(module):
    imported = importlib.import_module(module)
    missing = [name for name in getattr(imported, "__all__", []) if not hasattr(imported, name)]
    assert not missing, f"{module}.__all__ names what it lacks: {missing}"


@pytest.mark.parametrize("paths, names", table_rows(), ids=lambda value: str(value)[:60])
def test_documented_names_are_exposed(paths, names):
    exposing = []
    for path in paths:
        if is_module(path):
            exposing.append(importlib.import_module(path))
        else:  # a name of a package: `opacus_dp.GradSampleModuleFastGradientClipping`
            parent, _, name = path.rpartition(".")
            assert hasattr(importlib.import_module(parent), name), f"{path} is documented but absent"
    missing = [name for name in names if not any(hasattr(module, name) for module in exposing)]
    assert not missing, f"{paths} document {missing}, which none of them exposes"
