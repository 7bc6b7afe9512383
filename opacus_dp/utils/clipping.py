"""Opacus 0.x's import path ``opacus.utils.clipping`` (re-exports only): ``ClippingMethod``
(:mod:`opacus_dp.compat.clipping_method`)."""

from opacus_dp.compat.clipping_method import ClippingMethod

__all__ = ["ClippingMethod"]
