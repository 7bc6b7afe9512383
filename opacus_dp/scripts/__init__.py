"""Opacus 0.x ``opacus.scripts``: command-line helpers (see also ``python -m opacus_dp.cli``)."""

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
