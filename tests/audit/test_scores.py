"""Log-likelihood-ratio scores against the mixture densities computed with scipy."""

import numpy as np
import pytest
from scipy import stats

from opacus_dp.audit.scores import membership_scores


@pytest.mark.parametrize("q", [1.0, 0.3, 0.01])
def test_scores_are_the_log_likelihood_ratio(q):
    rng = np.random.default_rng(0)
    sigma = 1.7
    x = rng.standard_normal((5, 7)) * sigma + (rng.random((5, 7)) < 0.5)
    present = (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, 1, sigma)
    oracle = np.log(present / stats.norm.pdf(x, 0, sigma)).sum(axis=0)
    got = membership_scores(x, noise_multiplier=sigma, sample_rate=q)
    np.testing.assert_allclose(got, oracle, rtol=1e-10, atol=1e-12)


def test_full_batch_score_is_the_shifted_sum():
    x = np.array([[0.2, 1.4], [1.1, -0.3], [0.9, 0.0]])
    got = membership_scores(x, noise_multiplier=0.5, sample_rate=1.0)
    np.testing.assert_allclose(got, (x.sum(axis=0) - 1.5) / 0.25)
    np.testing.assert_allclose(membership_scores(x, noise_multiplier=0.0, sample_rate=1.0), x.sum(axis=0) - 1.5)


def test_bad_shapes_and_rates():
    with pytest.raises(ValueError, match="steps, canaries"):
        membership_scores(np.zeros(3), noise_multiplier=1.0, sample_rate=1.0)
    with pytest.raises(ValueError, match="sample_rate"):
        membership_scores(np.zeros((2, 3)), noise_multiplier=1.0, sample_rate=0.0)
