"""Strategy maths against dense matrix computations."""

import itertools

import pytest
import torch

from opacus_dp.mechanisms import cache, strategy_search, toeplitz
from opacus_dp.mechanisms.strategies import make_strategy
from opacus_dp.mechanisms.strategy_search import blt_column, sqrt_prefix_column


def workload(n, momentum=0.0):
    prefix = torch.tril(torch.ones(n, n, dtype=torch.float64))
    if momentum == 0:
        return prefix
    k = torch.arange(n)
    diff = (k[:, None] - k[None, :]).clamp(min=0).double()
    filt = torch.tril(momentum ** diff)  # heavy ball: m_t = β m_{t-1} + g_t
    return prefix @ filt


def brute_sensitivity(C, period):
    n = C.shape[0]
    best = 0.0
    for g in range(min(period, n)):
        cols = list(range(g, n, period))
        for r in range(1, len(cols) + 1):
            for subset in itertools.combinations(cols, r):
                best = max(best, float(C[:, list(subset)].sum(1).norm()))
    return best


def test_series_inverse_and_error_match_dense():
    n = 40
    c = torch.tensor([1.0, 0.6, -0.2, 0.3], dtype=torch.float64)
    C = toeplitz.dense(c, n)
    assert torch.allclose(toeplitz.dense(toeplitz.series_inverse(c, n), n), torch.linalg.inv(C), atol=1e-10)
    for beta in (0.0, 0.9):
        dense = (workload(n, beta) @ torch.linalg.inv(C)).square().sum()
        assert torch.allclose(toeplitz.squared_error_sum(c, n, beta), dense, rtol=1e-10)


def test_sqrt_prefix_column_squares_to_prefix_sums():
    n = 30
    C = toeplitz.dense(sqrt_prefix_column(n), n)
    assert torch.allclose(C @ C, workload(n), atol=1e-12)


@pytest.mark.parametrize("period", [1, 3, 5, 12])
def test_sensitivity_of_nonnegative_toeplitz_is_the_worst_participation(period):
    n = 12
    torch.manual_seed(0)
    c = blt_column(torch.rand(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64), n)
    expected = brute_sensitivity(toeplitz.dense(c, n), period)
    assert float(toeplitz.sensitivity(c, n, period)) == pytest.approx(expected, rel=1e-12)


def test_banded_column_norm_is_the_max_column_norm_for_any_signs():
    c = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
    C = toeplitz.dense(c, 10)
    assert float(toeplitz.sensitivity(c, 10, 10)) == pytest.approx(float(C.norm(dim=0).max()))


def test_optimised_banded_beats_identity_and_truncated_square_root(tmp_path):
    n, b = 64, 4
    s = make_strategy("banded", steps=n, bands=b, cache_dir=tmp_path)
    C = toeplitz.dense(torch.tensor(s.coefficients, dtype=torch.float64), n)
    assert torch.all(torch.tril(C, -b) == 0)  # b bands
    dense_mse = float(C.norm(dim=0).max() ** 2 * (workload(n) @ torch.linalg.inv(C)).square().sum() / n)
    assert s.mse == pytest.approx(dense_mse, rel=1e-9)
    assert s.sensitivity == pytest.approx(float(C.norm(dim=0).max()))
    start = make_strategy("independent", steps=n)
    assert start.mse == pytest.approx((n + 1) / 2) and start.mse_ratio == pytest.approx(1.0)
    truncated = sqrt_prefix_column(b)
    trunc_mse = float(toeplitz.sensitivity(truncated, n, n) ** 2 * toeplitz.squared_error_sum(truncated, n) / n)
    assert s.mse < trunc_mse < (n + 1) / 2
    assert len(s.coefficients) == b and s.coefficients[0] == 1.0


def test_blt_strategy_is_nonnegative_and_better_than_dp_sgd_without_amplification(tmp_path):
    n, period = 60, 10
    s = make_strategy("blt", steps=n, buffers=3, period=period, cache_dir=tmp_path)
    theta, omega = s.blt
    assert all(0 < t < 1 for t in theta) and all(w > 0 for w in omega)
    C = toeplitz.dense(s.column(), n)
    columns = [C[:, list(range(g, n, period))].sum(1).norm() for g in range(period)]
    assert s.sensitivity == pytest.approx(float(max(columns)), rel=1e-10)
    dp_sgd = (n // period) * (n + 1) / 2  # sensitivity √k, error ‖A‖²/n
    assert s.mse_ratio == pytest.approx(s.mse / dp_sgd) and s.mse_ratio < 0.5


def test_results_are_cached_by_configuration(tmp_path, monkeypatch):
    first = make_strategy("banded", steps=50, bands=3, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1

    def fail(*args, **kwargs):
        raise AssertionError("not cached")

    monkeypatch.setattr(strategy_search, "optimise_banded", fail)
    assert make_strategy("banded", steps=50, bands=3, cache_dir=tmp_path) == first
    with pytest.raises(AssertionError):
        make_strategy("banded", steps=50, bands=2, cache_dir=tmp_path)
    monkeypatch.setenv("OPACUS_DP_CACHE_DIR", str(tmp_path))
    assert cache.cache_directory() == str(tmp_path)


def test_invalid_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="bands"):
        make_strategy("banded", steps=10, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="noise mechanism"):
        make_strategy("tree-ish", steps=10)
    with pytest.raises(ValueError, match="momentum"):
        make_strategy("banded", steps=10, bands=2, momentum=1.0)
