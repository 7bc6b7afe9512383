"""Membership guesses by thresholding scores, and the ε lower bounds they certify.

Guess "in" for canary i iff ``score_i ≥ τ``. With ``n₋`` absent canaries of which ``FP`` are
guessed in and ``n₊`` present ones of which ``FN`` are guessed out, the Clopper–Pearson limits
``FPR⁺``, ``FNR⁺`` (joint confidence ``1 − α``) give the GDP and (ε, δ) bounds of
:mod:`~opacus_dp.audit.statistics`.

The confidence statement is honest only if τ does not depend on the evaluated guesses:
either τ is fixed in advance, or (``threshold="split"``) it is chosen on half of the canaries
(even positions) to maximise each bound there, and the bound is computed on the other half
(odd positions). Canaries are exchangeable (independent membership), so the split by position
is independent of the outcome.
"""

import math
from dataclasses import dataclass
from typing import Tuple, Union

import numpy as np

from opacus_dp.audit.statistics import (
    error_rate_upper_bounds,
    gdp_epsilon,
    mu_lower_bound,
    plain_epsilon_lower_bound,
)


@dataclass(frozen=True)
class ErrorRateBound:
    """Errors of the guesses at ``threshold`` and the bounds they imply (at the stated confidence)."""

    threshold: float
    negatives: int
    false_positives: int
    positives: int
    false_negatives: int
    fpr_upper: float
    fnr_upper: float
    mu_lower_bound: float
    epsilon_gdp: float
    epsilon_plain: float


def _as_arrays(scores, membership) -> Tuple[np.ndarray, np.ndarray]:
    scores, membership = np.asarray(scores, dtype=float), np.asarray(membership, dtype=bool)
    if scores.ndim != 1 or scores.shape != membership.shape:
        raise ValueError(f"scores and membership must be 1-d of equal length, got shapes "
                         f"{scores.shape} and {membership.shape}")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    return scores, membership


def error_counts(scores, membership, thresholds) -> Tuple[np.ndarray, int, np.ndarray, int]:
    """``(FP, n₋, FN, n₊)`` for each threshold (guess "in" iff score ≥ τ)."""
    scores, membership = _as_arrays(scores, membership)
    thresholds = np.asarray(thresholds, dtype=float)
    absent, present = np.sort(scores[~membership]), np.sort(scores[membership])
    false_positives = absent.size - np.searchsorted(absent, thresholds, side="left")
    false_negatives = np.searchsorted(present, thresholds, side="left")
    return false_positives, absent.size, false_negatives, present.size


def _rate_bounds(scores, membership, thresholds, confidence):
    fp, negatives, fn, positives = error_counts(scores, membership, thresholds)
    if negatives == 0 or positives == 0:
        ones = np.ones(np.shape(thresholds))
        return fp, negatives, fn, positives, ones, ones
    fpr_upper, fnr_upper = error_rate_upper_bounds(fp, negatives, fn, positives, confidence)
    return fp, negatives, fn, positives, fpr_upper, fnr_upper


def evaluate_threshold(scores, membership, threshold: float, *, delta: float,
                       confidence: float) -> ErrorRateBound:
    """The bounds certified by the guesses at a threshold fixed independently of these scores."""
    fp, negatives, fn, positives, fpr_upper, fnr_upper = _rate_bounds(
        scores, membership, np.array([threshold]), confidence)
    mu = float(mu_lower_bound(fpr_upper, fnr_upper)[0])
    return ErrorRateBound(
        threshold=float(threshold), negatives=int(negatives), false_positives=int(fp[0]),
        positives=int(positives), false_negatives=int(fn[0]), fpr_upper=float(fpr_upper[0]),
        fnr_upper=float(fnr_upper[0]), mu_lower_bound=mu, epsilon_gdp=gdp_epsilon(mu, delta),
        epsilon_plain=float(plain_epsilon_lower_bound(fpr_upper, fnr_upper, delta)[0]))


def best_thresholds(scores, membership, *, delta: float, confidence: float) -> Tuple[float, float]:
    """Thresholds maximising the μ (GDP) bound and the plain (ε, δ) bound on these canaries."""
    scores, _ = _as_arrays(scores, membership)
    candidates = np.append(np.unique(scores), math.inf)
    _, _, _, _, fpr_upper, fnr_upper = _rate_bounds(scores, membership, candidates, confidence)
    by_mu = candidates[int(np.argmax(mu_lower_bound(fpr_upper, fnr_upper)))]
    by_plain = candidates[int(np.argmax(plain_epsilon_lower_bound(fpr_upper, fnr_upper, delta)))]
    return float(by_mu), float(by_plain)


def threshold_audit(scores, membership, *, delta: float, confidence: float,
                    threshold: Union[str, float, Tuple[float, float]] = "split",
                    ) -> Tuple[ErrorRateBound, ErrorRateBound]:
    """``(for the GDP bound, for the plain bound)``: each holds with probability ≥ ``confidence``.

    ``threshold``: "split" (choose on even positions, evaluate on odd ones), or thresholds fixed
    without looking at these scores — one number for both bounds or a pair ``(τ_gdp, τ_plain)``
    — evaluated on all canaries.
    """
    scores, membership = _as_arrays(scores, membership)
    if isinstance(threshold, str):
        if threshold != "split":
            raise ValueError(f"threshold must be 'split', a number or a pair of numbers, got {threshold!r}")
        by_mu, by_plain = best_thresholds(scores[0::2], membership[0::2], delta=delta,
                                          confidence=confidence)
        scores, membership = scores[1::2], membership[1::2]
    elif isinstance(threshold, (tuple, list)) and len(threshold) == 2:
        by_mu, by_plain = (_check_threshold(t) for t in threshold)
    else:
        by_mu = by_plain = _check_threshold(threshold)
    return (evaluate_threshold(scores, membership, by_mu, delta=delta, confidence=confidence),
            evaluate_threshold(scores, membership, by_plain, delta=delta, confidence=confidence))


def _check_threshold(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"threshold must be 'split', a number or a pair of numbers, got {value!r}")
    return float(value)
