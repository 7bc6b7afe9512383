"""Which strategies may be used, and the one a configuration settles on.

Every strategy, optimised (:mod:`~opacus_dp.mechanisms.strategy_search`) or read from the
on-disk cache (:mod:`~opacus_dp.mechanisms.cache`), is checked by :func:`defect` before it is
used or cached: finite, of the configured shape, ``C ≥ 0`` for BLT, ``Δ > 0`` and never worse
than ``C = I``; otherwise ``C = I`` is used with a warning, or :class:`StrategyError` raised
(:func:`settled`).
"""

import enum
import math
import warnings
from typing import TYPE_CHECKING, Optional, Tuple

from opacus_dp.mechanisms import cache

if TYPE_CHECKING:  # annotations only: strategies imports this module, so importing it back is a cycle
    from opacus_dp.mechanisms.strategies import Strategy


class Defect(enum.Enum):
    """Why a strategy is refused (:func:`defect`)."""

    NOT_FINITE = "a coefficient, its sensitivity or its error is not finite"
    SHAPE = "its coefficients do not fit the configuration"
    NOT_NONNEGATIVE = "BLT needs 0 ≤ θ < 1 and ω ≥ 0 (C ≥ 0): the sensitivity formula assumes it"
    SENSITIVITY = "its sensitivity is not positive"
    WORSE_THAN_IDENTITY = "its error exceeds that of C = I (DP-SGD noise under the same analysis)"


class StrategyError(ValueError):
    """No valid strategy for a configuration; ``defect`` says why."""

    def __init__(self, message: str, defect: "Defect"):
        super().__init__(message)
        self.defect = defect


def defect(strategy: "Strategy", bands: Optional[int] = None, buffers: Optional[int] = None,
           tolerance: float = 1e-6) -> Optional[Defect]:
    """The first reason to refuse ``strategy``, or None: every coefficient, ``Δ``, the column
    norm and ``mse`` finite; ``c₀ = 1`` and ``bands`` (banded) or ``buffers`` (BLT) entries;
    BLT ``0 ≤ θ < 1``, ``ω ≥ 0``; ``Δ > 0``; and, except for tree aggregation (a fixed
    mechanism, not optimised), ``mse_ratio ≤ 1 + tolerance``: never worse than ``C = I``."""
    numbers = list(strategy.coefficients) + [strategy.sensitivity, strategy.column_norm, strategy.mse,
                                             strategy.mse_ratio]
    theta, omega = strategy.blt if strategy.blt is not None else ((), ())
    if not all(math.isfinite(x) for x in numbers + list(theta) + list(omega)):
        return Defect.NOT_FINITE
    if strategy.coefficients[0] != 1.0 or (bands is not None and len(strategy.coefficients) != bands) or (
            buffers is not None and not len(theta) == len(omega) == buffers):
        return Defect.SHAPE
    if not all(0 <= t < 1 for t in theta) or not all(w >= 0 for w in omega):
        return Defect.NOT_NONNEGATIVE
    if not (strategy.sensitivity > 0 and strategy.column_norm > 0):
        return Defect.SENSITIVITY
    if strategy.kind != "tree" and not strategy.mse_ratio <= 1 + tolerance:
        return Defect.WORSE_THAN_IDENTITY
    return None


def _checked(build, value, check) -> Tuple[Optional["Strategy"], Optional[Defect]]:
    try:
        strategy = build(value)
    except (TypeError, ValueError, KeyError, IndexError, RuntimeError):
        return None, Defect.SHAPE
    return strategy, check(strategy)


def settled(key: dict, cache_dir, build, optimise, identity, check) -> "Strategy":
    """The strategy of ``key``: the cached value if its strategy passes ``check``; else the
    optimised one (then cached); else ``C = I`` (``identity``) with a warning; else
    :class:`StrategyError`. ``build`` turns a value (a dict of lists) into a strategy."""
    found = cache.load(key, cache_dir)
    if found is not None:
        strategy, problem = _checked(build, found, check)
        if problem is None:
            return strategy
    value = optimise()
    strategy, problem = _checked(build, value, check)
    if problem is None:
        cache.store(key, value, cache_dir)
        return strategy
    where = "make_strategy(" + ", ".join(f"{k}={v!r}" for k, v in key.items() if k != "kind") + ")"
    fallback, fallback_problem = _checked(build, identity, check)
    if fallback_problem is not None:
        raise StrategyError(f"{where}: no valid {key['kind']} strategy ({problem.value}; C = I: "
                            f"{fallback_problem.value}); use noise_mechanism='independent'", problem)
    warnings.warn(f"{where}: the optimised {key['kind']} strategy was refused ({problem.value}); using "
                  "C = I, DP-SGD's noise under the same analysis. Other steps, bands or buffers may "
                  "optimise well.", RuntimeWarning, stacklevel=3)
    return fallback
