"""Noise calibration: the smallest σ (up to a tolerance) whose ε stays within a budget.

One generic bracketing search over any registered accountant: build a fresh accountant,
record the planned run as a single segment (σ, q, steps), read ε(δ).  ε decreases with σ; the
search (false position, falling back to bisection whenever a step shrinks the bracket by less
than half) keeps ``sigma_high`` with ε(sigma_high) ≤ target at all times and returns it, so the
result never exceeds the budget (for the chosen accountant).
"""

import math
import warnings
from typing import Optional

from opacus_dp.accountants.registry import create_accountant
from opacus_dp.accountants.validation import check_delta, check_sample_rate, check_steps, check_target_epsilon

MAX_SIGMA = 1e6
_MAX_BISECTIONS = 200


def planned_steps(*, sample_rate: float, epochs: Optional[float] = None, steps: Optional[int] = None) -> int:
    """Number of steps of the run: ``steps``, or ``⌈epochs / sample_rate⌉`` (never fewer than the run takes)."""
    if (epochs is None) == (steps is None):
        raise ValueError("give exactly one of epochs or steps")
    if steps is not None:
        count = check_steps(steps)
    else:
        if not (isinstance(epochs, (int, float)) and not isinstance(epochs, bool) and math.isfinite(epochs) and epochs > 0):
            raise ValueError(f"epochs must be a positive finite number, got {epochs!r}")
        # ceil, with a tolerance for round-off (3 / (1/75) = 224.99999...): never fewer steps
        count = int(math.ceil(epochs / sample_rate - 1e-9))
    if count < 1:
        raise ValueError(f"the run must have at least one step, got {count} (epochs={epochs}, steps={steps})")
    return count


def _epsilon_at(accountant_name: str, sigma: float, sample_rate: float, steps: int, delta: float, epsilon_kwargs):
    accountant = create_accountant(accountant_name)
    accountant.history = [(sigma, sample_rate, steps)]
    return accountant.get_epsilon(delta, **epsilon_kwargs)


def get_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    **epsilon_kwargs,
) -> float:
    """Noise multiplier σ such that the run spends at most ``target_epsilon`` at ``target_delta``.

    The returned σ satisfies ``target − tol/2 < ε(σ) ≤ target`` with
    ``tol = epsilon_tolerance × min(1, target_epsilon)`` (relative for ε ≥ 1, absolute below), so
    ε rounds to the target at the tolerance's precision: ``round(ε, 2) == 2.0`` for target 2 and
    the default 0.01, as Opacus's tests check (Opacus's own search stops anywhere in
    ``[target − tol, target]``);
    ``epsilon_kwargs`` go unchanged to ``accountant.get_epsilon`` (e.g. ``alphas`` for RDP).
    The default accountant is RDP, as in Opacus (``make_private_with_epsilon`` uses the
    engine's accountant).
    Raises ``ValueError`` when even σ = 10⁶ exceeds the budget.
    """
    target, delta, q, count = calibration_inputs(target_epsilon=target_epsilon, target_delta=target_delta,
                                                 sample_rate=sample_rate, epochs=epochs, steps=steps,
                                                 accountant=accountant, epsilon_tolerance=epsilon_tolerance)

    def eps(sigma: float) -> float:
        return _epsilon_at(accountant, sigma, q, count, delta, epsilon_kwargs)

    return search_sigma(eps, target, epsilon_tolerance * min(1.0, target) / 2)


def calibration_inputs(*, target_epsilon, target_delta, sample_rate, epochs, steps, accountant: str,
                       epsilon_tolerance: float):
    """``(target ε, δ, q, steps)`` of a calibration, each checked (named errors; q > 0; a known
    accountant; the tolerance in (0, 1))."""
    target = check_target_epsilon(target_epsilon)
    delta = check_delta(target_delta, "target_delta")
    q = check_sample_rate(sample_rate)
    if q == 0:
        raise ValueError("sample_rate must be > 0 to calibrate noise (q = 0 uses no data and costs no privacy)")
    if not 0 < epsilon_tolerance < 1:
        raise ValueError(f"epsilon_tolerance must lie in (0, 1), got {epsilon_tolerance!r}")
    count = planned_steps(sample_rate=q, epochs=epochs, steps=steps)
    create_accountant(accountant)  # fail early on an unknown name
    return target, delta, q, count


def search_sigma(eps, target: float, tolerance: float) -> float:
    """Largest-known σ with target − tolerance < eps(σ) ≤ target, for decreasing ``eps``."""
    sigma_low, sigma_high = 0.0, 1.0
    eps_low, eps_high = math.inf, eps(sigma_high)
    while eps_high > target:
        sigma_low, eps_low, sigma_high = sigma_high, eps_high, 2 * sigma_high
        if sigma_high > MAX_SIGMA:
            raise ValueError(f"the privacy budget target_epsilon={target} is too small for any sigma <= {MAX_SIGMA:g}")
        eps_high = eps(sigma_high)
    aim, use_interpolation = target - tolerance / 2, True
    for _ in range(_MAX_BISECTIONS):
        if target - eps_high < tolerance:
            return sigma_high
        width = sigma_high - sigma_low
        sigma = _next_sigma(sigma_low, sigma_high, eps_low - aim, eps_high - aim, use_interpolation)
        eps_mid = eps(sigma)
        if eps_mid <= target:
            sigma_high, eps_high = sigma, eps_mid
        else:
            sigma_low, eps_low = sigma, eps_mid
        use_interpolation = sigma_high - sigma_low < width / 2  # bisect after a poor step
    warnings.warn(
        f"noise calibration stopped at epsilon={eps_high:.6g} for target {target:.6g} (tolerance not reached)",
        RuntimeWarning,
        stacklevel=3,
    )
    return sigma_high


def _next_sigma(low: float, high: float, f_low: float, f_high: float, interpolate: bool) -> float:
    """False position on ε(σ) − aim inside (low, high); bisection when asked or undefined."""
    if interpolate and math.isfinite(f_low) and f_low > f_high:
        candidate = high - f_high * (high - low) / (f_high - f_low)
        if low < candidate < high:
            return candidate
    return (low + high) / 2
