"""Sub-modules as attributes of their package on first access (PEP 562), as ``import opacus``
makes ``opacus.validators``, ``opacus.grad_sample.utils``, ... available."""

import importlib
import importlib.util


def submodule_getattr(package: str):
    """A module-level ``__getattr__`` for ``package`` importing ``package.<name>`` when asked."""

    def __getattr__(name: str):
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
