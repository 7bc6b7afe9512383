"""``install_as_opacus()``: ``import opacus`` and ``opacus.X.Y`` resolve to opacus_dp's modules.

For libraries that import ``opacus`` inside their own modules (dp-transformers, federated-learning
frameworks, research code), where the user cannot rename the imports. An explicit opt-in, never
done implicitly: a meta-path finder placed first on ``sys.meta_path`` answers for ``opacus`` and
every ``opacus.*`` name, so it shadows an installed Opacus. ``sys.modules["opacus.X"]`` is then
the opacus_dp module object itself (``opacus.privacy_engine.PrivacyEngine is
opacus_dp.PrivacyEngine``), never a copy. The table of paths is
:mod:`opacus_dp.integrations.opacus_paths`.
"""

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Dict, Iterator

from opacus_dp.integrations.opacus_paths import OPACUS_PATHS, missing_message

_ROOT = "opacus"


class OpacusAlreadyImportedError(RuntimeError):
    """The real ``opacus`` is already imported, so its classes would mix with opacus_dp's."""


def _is_opacus_name(name: str) -> bool:
    return name == _ROOT or name.startswith(_ROOT + ".")


class OpacusAliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``opacus[.X]`` and loads it by putting the opacus_dp module in its ``sys.modules`` slot.

    The import system returns whatever ``sys.modules[name]`` holds after ``exec_module``, so the
    placeholder module it created is dropped and the opacus_dp module keeps its own ``__spec__``.
    A path without counterpart raises ``ModuleNotFoundError`` naming it and the migration guide.
    """

    def __init__(self):
        self.aliased: Dict[str, object] = {}

    def find_spec(self, fullname, path=None, target=None):
        if not _is_opacus_name(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # the default placeholder; exec_module replaces it in sys.modules

    def exec_module(self, module):
        fullname = module.__name__
        target_name = OPACUS_PATHS.get(fullname)
        if target_name is None:
            raise ModuleNotFoundError(missing_message(fullname), name=fullname)
        target = importlib.import_module(target_name)
        sys.modules[fullname] = target
        self.aliased[fullname] = target

    def remove_parent_attributes(self) -> None:
        """Undo ``setattr(parent, leaf, module)`` done by the import system where the alias's leaf
        name is not the opacus_dp module's own (``opacus.tests`` sets ``opacus_dp.tests``)."""
        for fullname, target in self.aliased.items():
            parent_name, _, leaf = fullname.rpartition(".")
            parent = self.aliased.get(parent_name)
            if parent is None or f"{parent.__name__}.{leaf}" == target.__name__:
                continue
            if getattr(parent, leaf, None) is target:
                delattr(parent, leaf)


def _installed_finder():
    return next((f for f in sys.meta_path if isinstance(f, OpacusAliasFinder)), None)


def _check_no_real_opacus() -> None:
    real = sorted(name for name, module in sys.modules.items()
                  if _is_opacus_name(name) and not getattr(module, "__name__", "").startswith("opacus_dp"))
    if real:
        where = getattr(sys.modules.get(_ROOT), "__file__", None) or "an installed package"
        raise OpacusAlreadyImportedError(
            f"the real opacus is already imported ({', '.join(real[:3])}{', ...' if len(real) > 3 else ''} "
            f"from {where}), so opacus_dp cannot stand in for it: call opacus_dp.install_as_opacus() "
            "before anything imports opacus (first lines of the script), or run the script with "
            "`python -m opacus_dp.as_opacus script.py ...`")


def install_as_opacus() -> None:
    """Make ``import opacus`` and Opacus 1.6's ``opacus.X.Y`` paths resolve to opacus_dp.

    Idempotent. Raises :class:`OpacusAlreadyImportedError` if the real ``opacus`` (or any of its
    modules) is already imported. Undo with :func:`uninstall_as_opacus`.
    """
    if _installed_finder() is not None:
        return
    _check_no_real_opacus()
    sys.meta_path.insert(0, OpacusAliasFinder())


def uninstall_as_opacus() -> None:
    """Remove the finder and every aliased ``opacus*`` entry of ``sys.modules`` (a no-op if the
    alias is not installed). Modules that already imported ``opacus`` keep what they imported."""
    finder = _installed_finder()
    if finder is None:
        return
    sys.meta_path.remove(finder)
    finder.remove_parent_attributes()
    for name in [n for n, m in sys.modules.items() if _is_opacus_name(n)]:
        if getattr(sys.modules[name], "__name__", "").startswith("opacus_dp"):
            del sys.modules[name]


@contextlib.contextmanager
def opacus_alias() -> Iterator[None]:
    """``with opacus_alias(): ...``: :func:`install_as_opacus` for the block only."""
    already = _installed_finder() is not None
    install_as_opacus()
    try:
        yield
    finally:
        if not already:
            uninstall_as_opacus()
