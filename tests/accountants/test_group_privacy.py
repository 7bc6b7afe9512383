"""Group privacy: the lemma's numbers by hand, the user-level ε against a grid search over δ',
the noise calibration for a user-level budget, and the engine's privacy_unit."""

import math
import pathlib
import re
import warnings

import numpy as np
import pytest

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import RDPAccountant, create_accountant, get_noise_multiplier
from opacus_dp.accountants.group_privacy import epsilon_for_privacy_unit, group_privacy, user_level_epsilon
from opacus_dp.accountants.user_level_calibration import get_user_level_noise_multiplier, user_level_epsilon_of_run

from .oracles import gaussian_delta, gaussian_epsilon

RUN = (1.1, 0.01, 1000)  # (σ, q, steps)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RDP's best-order warnings at tiny δ'
        yield


def rdp_curve(segment=RUN):
    accountant = RDPAccountant()
    accountant.history = [segment]
    return accountant.get_epsilon


def factor_by_sum(epsilon, k):
    """Σ_{i=0}^{k−1} e^{iε}, term by term."""
    return math.fsum(math.exp(i * epsilon) for i in range(k))


# ------------------------------------------------------------------ the lemma
def test_lemma_by_hand():
    """ε = 0.5, δ = 1e-6, k = 3: (1.5, δ (1 + e^0.5 + e^1))."""
    epsilon_k, delta_k = group_privacy(0.5, 1e-6, 3)
    assert epsilon_k == 1.5
    assert delta_k == pytest.approx(1e-6 * (1 + 1.6487212707001282 + 2.718281828459045), rel=1e-14)
    assert delta_k <= 3 * math.exp(2 * 0.5) * 1e-6  # the looser k e^{(k−1)ε} δ


@pytest.mark.parametrize("epsilon,delta,k", [(0.0, 1e-5, 4), (2.0, 1e-8, 1), (1.3, 0.0, 5), (0.01, 1e-3, 50)])
def test_lemma_matches_the_sum(epsilon, delta, k):
    epsilon_k, delta_k = group_privacy(epsilon, delta, k)
    assert epsilon_k == pytest.approx(k * epsilon, rel=1e-15)
    assert delta_k == pytest.approx(delta * factor_by_sum(epsilon, k), rel=1e-12)


def test_lemma_does_not_overflow():
    assert group_privacy(800.0, 1e-6, 3) == (2400.0, math.inf)
    assert group_privacy(20.0, 1e-300, 3)[1] == pytest.approx(1e-300 * factor_by_sum(20.0, 3), rel=1e-12)


@pytest.mark.parametrize("mu,k", [(0.5, 2), (0.5, 4), (1.0, 3), (0.2, 8)])
@pytest.mark.parametrize("epsilon", [0.5, 1.0, 2.0])
def test_lemma_holds_for_the_gaussian_mechanism(mu, k, epsilon):
    """A Gaussian mechanism of sensitivity 1 and noise 1/μ is, on k records, the Gaussian of
    sensitivity k: its exact δ at kε (Balle & Wang 2018) is at most the lemma's δ_k."""
    _, delta_k = group_privacy(epsilon, gaussian_delta(epsilon, mu), k)
    assert gaussian_delta(k * epsilon, k * mu) <= delta_k


# ------------------------------------------------------------------ user_level_epsilon
def grid_best(epsilon_at, delta_user, k, points=3000, lowest=-200.0):
    """Smallest k ε(δ') over a grid of log δ' whose points satisfy δ' Σ e^{iε(δ')} ≤ δ_user."""
    best = math.inf
    for log_delta in np.linspace(lowest, math.log(delta_user), points):
        delta = math.exp(log_delta)
        epsilon = epsilon_at(delta)
        if delta * factor_by_sum(epsilon, k) <= delta_user:
            best = min(best, k * epsilon)
    return best


@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_user_level_epsilon_beats_a_grid_search_and_is_feasible(k):
    curve = rdp_curve()
    epsilon_user, delta_example = user_level_epsilon(curve, 1e-5, k)
    assert epsilon_user == k * curve(delta_example)
    assert delta_example * factor_by_sum(curve(delta_example), k) <= 1e-5
    assert epsilon_user <= grid_best(curve, 1e-5, k)


def test_user_level_epsilon_of_the_gaussian_mechanism_is_at_least_the_exact_one():
    """ε(δ') of a μ-Gaussian mechanism; the exact user-level ε is that of the kμ-Gaussian."""
    mu, k = 0.3, 4
    epsilon_user, _ = user_level_epsilon(lambda delta: gaussian_epsilon(mu, delta), 1e-6, k)
    assert gaussian_epsilon(k * mu, 1e-6) <= epsilon_user <= grid_best(lambda d: gaussian_epsilon(mu, d), 1e-6, k,
                                                                        points=400, lowest=-60.0)


def test_an_irregular_curve_never_gives_an_infeasible_point():
    """A curve with jitter (as discretised accountants have): every answer stays feasible."""
    rng = np.random.default_rng(0)
    jitter = {}

    def curve(delta):
        return 2.0 * math.sqrt(math.log(1 / delta)) + jitter.setdefault(delta, rng.uniform(0, 0.3))

    for k in (2, 4, 7):
        epsilon_user, delta_example = user_level_epsilon(curve, 1e-5, k)
        assert math.isfinite(epsilon_user)
        assert delta_example * factor_by_sum(curve(delta_example), k) <= 1e-5
        assert epsilon_user == k * curve(delta_example)


def test_k_one_is_the_example_level_epsilon_exactly():
    curve = rdp_curve()
    assert user_level_epsilon(curve, 1e-5, 1) == (curve(1e-5), 1e-5)


def test_user_level_epsilon_grows_with_k():
    curve = rdp_curve()
    values = [user_level_epsilon(curve, 1e-5, k)[0] for k in range(1, 11)]
    assert all(a < b for a, b in zip(values, values[1:]))
    assert values[1] > 2 * values[0]  # more than linear: δ' must shrink as k grows


def test_no_privacy_loss_and_no_noise():
    nothing = rdp_curve((1.0, 0.0, 100))
    epsilon_user, delta_example = user_level_epsilon(nothing, 1e-5, 4)
    assert epsilon_user == 0.0 and 4 * delta_example <= 1e-5
    assert delta_example == pytest.approx(1e-5 / 4, rel=1e-9)
    no_noise = rdp_curve((0.0, 0.1, 10))
    assert user_level_epsilon(no_noise, 1e-5, 4) == (math.inf, 0.0)


@pytest.mark.parametrize("k,error,message", [
    (0, ValueError, "max_examples_per_user must be >= 1"),
    (-2, ValueError, "max_examples_per_user must be >= 1"),
    (2.0, TypeError, "max_examples_per_user must be an integer"),
    (True, TypeError, "max_examples_per_user must be an integer"),
    ("3", TypeError, "max_examples_per_user must be an integer"),
])
def test_bad_group_sizes_are_refused(k, error, message):
    with pytest.raises(error, match=message):
        user_level_epsilon(rdp_curve(), 1e-5, k)


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, math.nan])
def test_bad_user_deltas_are_refused(delta):
    with pytest.raises(ValueError, match="delta_user must lie in the open interval"):
        user_level_epsilon(rdp_curve(), delta, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(privacy_unit="users", max_examples_per_user=2), "privacy_unit must be one of"),
    (dict(privacy_unit="user"), "needs max_examples_per_user"),
    (dict(privacy_unit="example", max_examples_per_user=2), "applies only to privacy_unit='user'"),
])
def test_privacy_unit_arguments_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        epsilon_for_privacy_unit(rdp_curve(), 1e-5, **kwargs)


def test_bad_group_privacy_arguments_are_refused():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        group_privacy(-1.0, 1e-5, 2)
    with pytest.raises(ValueError, match="delta must lie in"):
        group_privacy(1.0, 2.0, 2)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_privacy(1.0, 1e-5, 0)


# ------------------------------------------------------------------ accountants and engine
@pytest.mark.parametrize("name", ["rdp", "prv", "gdp"])
def test_accountant_method_and_engine_give_the_group_privacy_epsilon(name):
    engine = PrivacyEngine(accountant=name)
    engine.accountant.history = [RUN]
    expected = user_level_epsilon(engine.accountant.get_epsilon, 1e-5, 3)
    assert engine.accountant.get_user_level_epsilon(1e-5, 3) == expected
    assert engine.get_epsilon(1e-5, privacy_unit="user", max_examples_per_user=3) == expected[0]
    assert engine.get_epsilon(1e-5) == engine.get_epsilon(1e-5, privacy_unit="user", max_examples_per_user=1)
    assert engine.get_epsilon(1e-5) == float(engine.accountant.get_epsilon(1e-5))


def test_accountant_options_reach_get_epsilon():
    accountant = RDPAccountant()
    accountant.history = [RUN]
    orders = [2, 4, 8, 16, 32]
    expected = user_level_epsilon(lambda delta: accountant.get_epsilon(delta, alphas=orders), 1e-5, 2)
    assert accountant.get_user_level_epsilon(1e-5, 2, alphas=orders) == expected
    assert expected != accountant.get_user_level_epsilon(1e-5, 2)


def test_engine_refuses_a_user_unit_without_k():
    engine = PrivacyEngine(accountant="rdp")
    with pytest.raises(ValueError, match="needs max_examples_per_user"):
        engine.get_epsilon(1e-5, privacy_unit="user")


# ------------------------------------------------------------------ calibration
@pytest.mark.parametrize("target,k,q,steps", [(3.0, 2, 0.01, 1000), (8.0, 4, 0.02, 500), (0.8, 3, 0.005, 2000)])
def test_user_level_calibration_meets_the_target_from_below(target, k, q, steps):
    sigma = get_user_level_noise_multiplier(target_epsilon=target, target_delta=1e-5, max_examples_per_user=k,
                                            sample_rate=q, steps=steps, accountant="rdp")
    epsilon_user, _ = user_level_epsilon(rdp_curve((sigma, q, steps)), 1e-5, k)
    assert target - 0.01 * min(1.0, target) <= epsilon_user <= target


def test_user_level_calibration_with_k_one_is_the_example_level_one():
    options = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=800, accountant="rdp")
    assert get_user_level_noise_multiplier(max_examples_per_user=1, **options) == get_noise_multiplier(**options)


def test_user_level_noise_grows_with_k_and_the_run_function_agrees():
    sigmas = [get_user_level_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, max_examples_per_user=k,
                                              sample_rate=0.01, steps=500, accountant="rdp") for k in (1, 2, 4)]
    assert sigmas[0] < sigmas[1] < sigmas[2]
    epsilon_user, delta_example = user_level_epsilon_of_run(noise_multiplier=sigmas[2], sample_rate=0.01, steps=500,
                                                             delta=1e-5, max_examples_per_user=4)
    assert epsilon_user <= 4.0 and delta_example < 1e-5 / 4


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_examples_per_user=0), "max_examples_per_user"),
    (dict(target_epsilon=-1.0), "target_epsilon"),
    (dict(target_delta=1.0), "target_delta"),
    (dict(sample_rate=0.0), "sample_rate"),
    (dict(accountant="moments"), "unknown accountant"),
])
def test_user_level_calibration_refuses_bad_arguments(kwargs, message):
    options = dict(target_epsilon=2.0, target_delta=1e-5, max_examples_per_user=2, sample_rate=0.01, steps=100,
                   accountant="rdp")
    with pytest.raises(ValueError, match=message):
        get_user_level_noise_multiplier(**{**options, **kwargs})


def test_prv_user_level_epsilon_of_a_run():
    epsilon_user, delta_example = user_level_epsilon_of_run(noise_multiplier=1.1, sample_rate=0.01, steps=1000,
                                                            delta=1e-5, max_examples_per_user=2, accountant="prv")
    accountant = create_accountant("prv")
    accountant.history = [RUN]
    assert epsilon_user == 2 * accountant.get_epsilon(delta_example)
    assert delta_example * factor_by_sum(epsilon_user / 2, 2) <= 1e-5


ROUNDING_SLACK = 1e-5  # relative: PRV's ε differs between machines in its 6th digit


def test_the_documented_table_is_what_the_code_computes():
    """docs/user_level.md: the digits run (60 steps at q = 1/3, σ for ε = 3 at δ = 1e-5, PRV), at
    that σ rounded to 3.78 as the snippet does: the calibration may end anywhere in its window
    (2.995 < ε ≤ 3), a point that moves with ε's last bits between machines (σ 1e-4 apart moved
    ε_user at k = 8 by 0.02). Each printed ε is the computed one to its last digit, give or take
    ``ROUNDING_SLACK`` of it: at σ = 3.78 PRV's ε for k = 4 is 20.71502 on one machine and just
    below 20.715 on another (floating-point sums in another order), printed 20.72 or 20.71."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "user_level.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| \(([\d.]+), ([\d.e+-]+)\) \| ([\d.]+) \|$", text, re.MULTILINE)
    assert [int(row[0]) for row in rows] == [1, 2, 4, 8]
    sigma = round(get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=1 / 3, steps=60,
                                       accountant="prv"), 2)
    assert sigma == 3.78 and "user-level ε at σ = 3.78" in text
    for k, epsilon_user, epsilon_example, delta_example, sigma_for_three in rows:
        run = dict(sample_rate=1 / 3, steps=60, delta=1e-5, max_examples_per_user=int(k), accountant="prv")
        computed, computed_delta = user_level_epsilon_of_run(noise_multiplier=sigma, **run)
        for value, printed in ((computed, epsilon_user), (computed / int(k), epsilon_example)):
            assert abs(value - float(printed)) <= 0.005 + ROUNDING_SLACK * value, (k, value, printed)
        assert f"{computed_delta:.1e}" == delta_example
        at_documented_sigma, _ = user_level_epsilon_of_run(noise_multiplier=float(sigma_for_three), **run)
        assert 2.98 <= at_documented_sigma <= 3.0
