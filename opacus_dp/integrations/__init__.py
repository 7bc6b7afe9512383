"""Integrations of opacus_dp with code written for other libraries.

* :func:`install_as_opacus` — libraries that ``import opacus`` themselves run on opacus_dp
  (:mod:`opacus_dp.integrations.as_opacus`; launcher ``python -m opacus_dp.as_opacus``).
"""

from opacus_dp.integrations.as_opacus import (OpacusAlreadyImportedError, install_as_opacus, opacus_alias,
                                              uninstall_as_opacus)

__all__ = ["OpacusAlreadyImportedError", "install_as_opacus", "opacus_alias", "uninstall_as_opacus"]
