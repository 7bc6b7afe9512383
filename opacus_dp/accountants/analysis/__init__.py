"""Privacy analysis behind the accountants: RDP (``rdp``), Gaussian DP (``gdp``) and grid
privacy loss distributions composed by FFT (``prv``)."""

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
