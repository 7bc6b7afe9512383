"""Opacus 1.x's import path ``opacus.optimizers.optimizer`` (re-exports only): :class:`DPOptimizer`
and ``_generate_noise`` (one ``N(0, std²)`` draw shaped like ``reference``)."""

from opacus_dp.compat.optimizer_utils import generate_noise as _generate_noise  # noqa: F401
from opacus_dp.optimizers import DPOptimizer

__all__ = ["DPOptimizer"]
