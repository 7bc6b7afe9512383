"""Argument checks shared by the accountants, the calibration and the calculator.

Each check raises a ``ValueError``/``TypeError`` that names the offending argument and
says what a valid value looks like; each returns the value as a plain Python number.
"""

import math
import numbers
import warnings
from typing import Optional


def as_real(value, name: str) -> float:
    """``value`` as float if it is a real number (NumPy scalars included; not bool), else TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def check_noise_multiplier(noise_multiplier, name: str = "noise_multiplier") -> float:
    """σ must be a finite real number ≥ 0 (σ = 0 means no noise, ε = ∞)."""
    sigma = as_real(noise_multiplier, name)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {noise_multiplier!r}")
    return sigma


def check_sample_rate(sample_rate, name: str = "sample_rate") -> float:
    """q is a probability: a real number in [0, 1]."""
    q = as_real(sample_rate, name)
    if not 0.0 <= q <= 1.0:
        raise ValueError(
            f"{name} must lie in [0, 1] (probability that a record joins a batch), got {sample_rate!r}"
        )
    return q


def check_delta(delta, name: str = "delta") -> float:
    """δ must lie strictly between 0 and 1."""
    d = as_real(delta, name)
    if not 0.0 < d < 1.0:
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {delta!r}")
    return d


def warn_if_delta_not_small(delta: float, num_records: Optional[int], name: str = "target_delta") -> None:
    """Warn when ``δ ≥ 1/N``: releasing one random record in the clear is then (0, δ)-DP, so
    the guarantee says little; δ ≪ 1/N is the usual choice (Dwork & Roth 2014, §2.3). Nothing
    to check when ``N`` is unknown (None)."""
    if num_records is not None and num_records > 0 and delta >= 1.0 / num_records:
        warnings.warn(
            f"{name}={delta!r} is not below 1/N = 1/{num_records}: a mechanism that publishes one "
            f"random record in the clear satisfies (0, {delta!r})-DP, so this guarantee says "
            f"little; choose {name} much smaller than 1/N (e.g. 1e-5 or 1/(10 N))",
            UserWarning, stacklevel=3,
        )


MAX_STEPS = 2**63 - 1  # a step count beyond int64 cannot be turned into a float computation


def check_steps(steps, name: str = "steps") -> int:
    """A number of steps: an integer in [0, 2⁶³ − 1] (floats with an integral value are accepted)."""
    if isinstance(steps, bool):
        raise TypeError(f"{name} must be an integer, got {steps!r}")
    if isinstance(steps, numbers.Integral):
        value = int(steps)
    elif isinstance(steps, numbers.Real) and float(steps).is_integer():
        value = int(steps)
    else:
        raise TypeError(f"{name} must be an integer number of steps, got {steps!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {steps!r}")
    if value > MAX_STEPS:
        raise ValueError(f"{name} must be at most 2**63 - 1, got {steps!r}")
    return value


def check_target_epsilon(target_epsilon, name: str = "target_epsilon") -> float:
    """A privacy budget ε must be finite and > 0."""
    eps = as_real(target_epsilon, name)
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name} must be finite and > 0, got {target_epsilon!r}")
    return eps


def check_orders(orders, name: str = "alphas") -> list:
    """RDP orders: a non-empty sequence of real numbers > 1."""
    values = [orders] if isinstance(orders, numbers.Real) else list(orders)
    if not values:
        raise ValueError(f"{name} must contain at least one RDP order > 1")
    result = []
    for order in values:
        alpha = as_real(order, name)
        if not alpha > 1.0:
            raise ValueError(f"{name} must contain only RDP orders > 1, got {order!r}")
        result.append(alpha)
    return result
