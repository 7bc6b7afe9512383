"""Threshold guesses: error counts, honest threshold choice, coverage of the bounds."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from opacus_dp.audit.claimed_model import model_thresholds, simulate_scores
from opacus_dp.audit.statistics import clopper_pearson_upper, gdp_epsilon
from opacus_dp.audit.threshold_test import error_counts, evaluate_threshold, threshold_audit


@settings(max_examples=20, deadline=None)
@given(data=st.data(), size=st.integers(2, 40))
def test_error_counts_match_a_loop(data, size):
    scores = np.array(data.draw(st.lists(st.integers(-5, 5), min_size=size, max_size=size)), dtype=float)
    member = np.array(data.draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    thresholds = np.array([-6.0, -0.5, 0.0, 2.0, 9.0])
    fp, negatives, fn, positives = error_counts(scores, member, thresholds)
    for j, tau in enumerate(thresholds):
        assert fp[j] == sum(1 for s, b in zip(scores, member) if not b and s >= tau)
        assert fn[j] == sum(1 for s, b in zip(scores, member) if b and s < tau)
    assert negatives == (~member).sum() and positives == member.sum()


def test_evaluate_threshold_by_hand():
    scores = np.array([3.0, 2.0, -1.0, 0.5, -2.0, 1.0])
    member = np.array([True, True, True, False, False, False])
    result = evaluate_threshold(scores, member, 0.8, delta=1e-5, confidence=0.9)
    assert (result.false_positives, result.negatives) == (1, 3)  # score 1.0
    assert (result.false_negatives, result.positives) == (1, 3)  # score -1.0
    assert result.fpr_upper == pytest.approx(float(clopper_pearson_upper(1, 3, 0.05)))
    assert result.epsilon_gdp == 0.0  # three trials per side prove nothing


def _gaussian_trials(mu, m, rng):
    member = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * member, member


@pytest.mark.parametrize("choice", ["split", "model", "fixed"])
def test_bounds_hold_with_the_stated_confidence(choice):
    """Exact μ-GDP trials: μ_lo > μ (and ε bounds > ε(μ)) in at most 5% of audits."""
    rng = np.random.default_rng(11)
    mu, m, delta, runs = 1.0, 300, 1e-5, 150
    thresholds = {"split": "split", "fixed": mu / 2}
    if choice == "model":  # scores on the LLR scale of T = 1 step with σ = 1/μ
        thresholds["model"] = model_thresholds(noise_multiplier=1 / mu, sample_rate=1.0, steps=1,
                                               negatives=m // 2, positives=m // 2, delta=delta,
                                               confidence=0.95)
    exceed_mu = exceed_plain = 0
    for _ in range(runs):
        scores, member = _gaussian_trials(mu, m, rng)
        if choice == "model":
            scores = (scores / mu - 0.5) * mu ** 2  # observation x = z/μ, LLR = (x - 1/2)·μ²
        gdp, plain = threshold_audit(scores, member, delta=delta, confidence=0.95,
                                     threshold=thresholds[choice])
        exceed_mu += gdp.mu_lower_bound > mu
        exceed_plain += plain.epsilon_plain > gdp_epsilon(mu, delta)
    assert exceed_mu / runs <= 0.05 and exceed_plain / runs <= 0.05


def test_choosing_the_threshold_on_the_evaluated_data_would_be_dishonest():
    """Negative control at 80 % confidence: the best of many thresholds on the evaluated data
    overshoots μ more often than the nominal 20 %; the split choice stays below it."""
    from opacus_dp.audit.threshold_test import best_thresholds

    rng = np.random.default_rng(12)
    mu, m, runs, confidence = 0.5, 200, 150, 0.8
    cheat = split = 0
    for _ in range(runs):
        scores, member = _gaussian_trials(mu, m, rng)
        tau, _ = best_thresholds(scores, member, delta=1e-5, confidence=confidence)
        cheat += evaluate_threshold(scores, member, tau, delta=1e-5, confidence=confidence).mu_lower_bound > mu
        split += threshold_audit(scores, member, delta=1e-5, confidence=confidence)[0].mu_lower_bound > mu
    assert cheat / runs > 1 - confidence >= split / runs


def test_model_thresholds_sit_where_the_claim_separates_best():
    sigma, steps = 2.0, 4  # μ = 1: LLR ~ N(∓μ²/2, μ²) i.e. N(∓0.5, 1)
    tau_mu, tau_plain = model_thresholds(noise_multiplier=sigma, sample_rate=1.0, steps=steps,
                                         negatives=2000, positives=2000, delta=1e-5, confidence=0.95)
    assert -1.0 < tau_mu < 1.5
    assert abs(tau_plain) > 1.0  # the plain bound needs a tail
    absent, present = simulate_scores(noise_multiplier=sigma, sample_rate=1.0, steps=steps, size=20000)
    assert absent.mean() == pytest.approx(-0.5, abs=0.03) and present.mean() == pytest.approx(0.5, abs=0.03)
    assert absent.std() == pytest.approx(1.0, abs=0.03)


def test_bad_threshold_arguments():
    with pytest.raises(ValueError, match="threshold"):
        threshold_audit([0.0, 1.0], [True, False], delta=1e-5, confidence=0.95, threshold="best")
    with pytest.raises(ValueError, match="same|equal"):
        threshold_audit([0.0, 1.0], [True], delta=1e-5, confidence=0.95)
