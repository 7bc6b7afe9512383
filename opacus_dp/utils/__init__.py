"""Utilities and Opacus-compatible import paths (``opacus_dp.utils.uniform_sampler``, ...)."""

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
