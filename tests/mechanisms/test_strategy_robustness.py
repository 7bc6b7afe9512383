"""The strategy optimiser never returns a non-finite strategy, nor one worse than C = I, and a
bad cache entry is never used.

Oracles: dense matrices (``torch.linalg``), the noise recursions written out in numpy, a
closed form of the one-coefficient banded loss scanned on a grid, and every point the
optimiser evaluated.
"""

import hashlib
import json
import math
import os
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.mechanisms import cache, strategy_search, strategy_validation, toeplitz
from opacus_dp.mechanisms.strategies import make_strategy

STEPS = (10, 100, 400, 480, 2000, 3200)


def dense_mse(column, n, period):
    """``Δ²‖A C⁻¹‖²_F / n`` from dense matrices; ``Δ`` the worst residue's summed columns (C ≥ 0
    or period ≥ n, see toeplitz.sensitivity)."""
    C = toeplitz.dense(column, n)
    A = torch.tril(torch.ones(n, n, dtype=torch.float64))
    error = torch.linalg.solve_triangular(C, A, upper=False, left=False).square().sum() / n
    sens = max(float(C[:, g::period].sum(1).norm()) for g in range(min(period, n)))
    return sens, float(sens ** 2 * error)


def banded_noise_coefficients(c, n):
    """First column of ``C⁻¹`` by the banded noise recursion ``z_t = w_t − Σ_k c_k z_{t−k}``."""
    z = np.zeros(n)
    for t in range(n):
        z[t] = (t == 0) - sum(c[k] * z[t - k] for k in range(1, min(len(c), t + 1)))
    return z


def assert_sound(strategy, *, identity_ratio=1.0):
    assert all(math.isfinite(x) for x in strategy.coefficients)
    assert math.isfinite(strategy.sensitivity) and strategy.sensitivity > 0
    assert math.isfinite(strategy.mse) and strategy.mse_ratio <= identity_ratio + 1e-9


@pytest.mark.parametrize("bands", [2, 3, 4, 8])
def test_banded_grid_is_finite_stable_and_no_worse_than_dp_sgd(bands, tmp_path):
    for n in STEPS:
        s = make_strategy("banded", steps=n, bands=bands, cache_dir=tmp_path)
        assert_sound(s)
        assert len(s.coefficients) == min(bands, n)
        c = np.array(s.coefficients)
        assert s.sensitivity == pytest.approx(float(np.linalg.norm(c)), rel=1e-12)  # max column norm
        z = banded_noise_coefficients(c, n)  # the noise the steps get stays bounded
        assert np.all(np.isfinite(z)) and np.abs(z).max() <= 1 + 1e-9
        if n <= 480:
            sens, mse = dense_mse(torch.tensor(c), n, n)
            assert s.mse == pytest.approx(mse, rel=1e-8) and s.sensitivity == pytest.approx(sens, rel=1e-10)
        else:  # error from the recursion's noise coefficients: Σ_k (n − k) (prefix sum of z)_k² / n
            g = np.cumsum(z)
            assert s.mse == pytest.approx(float(c @ c) * float(np.sum(np.arange(n, 0, -1) * g * g)) / n, rel=1e-8)


def two_band_loss(a, n):
    """Closed form for ``c = [1, a]``: ``C⁻¹`` has ``(−a)ᵏ``, prefix sums ``(1 − (−a)^{k+1})/(1 + a)``."""
    a = np.asarray(a, dtype=np.float64)[:, None]
    k = np.arange(n)[None, :]
    g = (1 - (-a) ** (k + 1)) / (1 + a)
    return (1 + a[:, 0] ** 2) * (np.arange(n, 0, -1)[None, :] * g * g).sum(1) / n


@pytest.mark.parametrize("n", STEPS)
def test_two_bands_reach_the_one_dimensional_optimum(n, tmp_path):
    s = make_strategy("banded", steps=n, bands=2, cache_dir=tmp_path)
    grid = np.linspace(-0.99, 0.999, 1990)
    losses = two_band_loss(grid, n)
    assert s.mse <= losses.min() * (1 + 1e-9)  # no point of a fine grid is better
    assert s.mse == pytest.approx(float(two_band_loss([s.coefficients[1]], n)[0]), rel=1e-9)
    assert abs(s.coefficients[1] - grid[losses.argmin()]) < 5e-3


@pytest.mark.parametrize("period", [5, 20, 50])
def test_blt_grid_is_finite_nonnegative_and_no_worse_than_dp_sgd(period, tmp_path):
    for epochs in range(1, 7):
        n = period * epochs
        s = make_strategy("blt", steps=n, period=period, cache_dir=tmp_path)
        assert_sound(s)
        theta, omega = s.blt
        assert all(0 <= t < 1 for t in theta) and all(w >= 0 for w in omega)
        sens, mse = dense_mse(s.column(), n, period)
        assert s.sensitivity == pytest.approx(sens, rel=1e-10) and s.mse == pytest.approx(mse, rel=1e-8)
        assert s.mse_ratio == pytest.approx(mse / (epochs * (n + 1) / 2), rel=1e-8)  # C = I: Δ² = epochs


def test_blt_matches_the_published_optimum_for_100_steps_of_period_20(tmp_path):
    """JAX Privacy's BLT optimiser reports loss 36.30 for n = 100, min_sep = 20 (5 participations);
    its loss is sensitivity² × the mean over steps of the prefix sums' squared error, our ``mse``."""
    s = make_strategy("blt", steps=100, period=20, cache_dir=tmp_path)
    assert_sound(s)
    assert s.mse <= 36.30 * 1.001
    assert s.mse == pytest.approx(dense_mse(s.column(), 100, 20)[1], rel=1e-8)


@pytest.mark.parametrize("n", [10, 100, 400, 3200])
def test_tree_grid_is_finite(n):
    for period in (1, 5, 20, 50) + ((n,) if n <= 400 else ()):
        s = make_strategy("tree", steps=n, period=period)
        assert math.isfinite(s.sensitivity) and s.sensitivity >= 1 and math.isfinite(s.mse_ratio)
        if n >= 100 and period >= 20:  # few participations: tree predicts less error than DP-SGD
            assert s.mse_ratio <= 1


def test_minimise_returns_the_best_point_it_evaluated():
    """Two bands in raw coefficients at 400 steps: L-BFGS steps past c₁ = 1, where C⁻¹ grows
    like c₁ⁿ and the loss overflows; the result must still be the best point evaluated."""
    n, seen = 400, []
    one = torch.ones(1, dtype=torch.float64)

    def loss_of(t):
        value = strategy_search.strategy_loss(torch.cat([one, t]), n, n, 0.0)
        seen.append(float(value.detach()))
        return value

    point = strategy_search._minimise(torch.tensor([0.5], dtype=torch.float64), loss_of, 200)
    finite = [v for v in seen if math.isfinite(v)]
    result = float(strategy_search.strategy_loss(torch.cat([one, point]), n, n, 0.0))
    assert math.isfinite(result) and result == pytest.approx(min(finite), rel=1e-12)


def test_minimise_backs_off_from_a_non_finite_region():
    """``(x − 1)² + 1`` that is NaN beyond ``x = 1.01``: the optimum sits at the edge."""
    def loss_of(x):
        return torch.where(x < 1.01, (x - 1) ** 2 + 1, torch.full_like(x, math.nan)).sum()

    point = strategy_search._minimise(torch.tensor([-30.0], dtype=torch.float64), loss_of, 100)
    assert float(point) == pytest.approx(1.0, abs=1e-4)


def poison(tmp_path, key, value, version=None):
    version = cache.VERSION if version is None else version
    text = json.dumps({"version": version, **key}, sort_keys=True)
    path = os.path.join(str(tmp_path), hashlib.sha256(text.encode()).hexdigest() + ".json")
    with open(path, "w") as handle:
        json.dump({"key": {"version": version, **key}, "value": value}, handle)
    return path


@pytest.mark.parametrize("value", [
    {"c": [1.0, float("nan")]},          # non-finite
    {"c": [1.0, 2.0]},                   # finite, but C⁻¹ grows like 2ⁿ
    {"c": [1.0, 0.5, 0.2]},              # more bands than the key
    {"c": "1.0"},                        # malformed
])
def test_a_poisoned_banded_cache_entry_is_never_used(tmp_path, value):
    key = {"kind": "banded", "steps": 400, "bands": 2, "momentum": 0.0}
    path = poison(tmp_path, key, value)
    s = make_strategy("banded", steps=400, bands=2, cache_dir=tmp_path)
    assert_sound(s)
    assert s.mse == pytest.approx(float(two_band_loss([s.coefficients[1]], 400)[0]), rel=1e-9)
    with open(path) as handle:  # replaced by the valid strategy
        assert json.load(handle)["value"] == {"c": list(s.coefficients)}


@pytest.mark.parametrize("theta, omega", [
    ([0.9, 0.5], [0.3, -0.2]),            # ω < 0: C has negative entries, the sensitivity bound fails
    ([1.5, 0.5], [0.3, 0.2]),             # θ > 1
    ([0.9, float("inf")], [0.3, 0.2]),
])
def test_a_poisoned_blt_cache_entry_is_never_used(tmp_path, theta, omega):
    key = {"kind": "blt", "steps": 40, "buffers": 2, "period": 20, "momentum": 0.0}
    poison(tmp_path, key, {"theta": theta, "omega": omega})
    s = make_strategy("blt", steps=40, buffers=2, period=20, cache_dir=tmp_path)
    assert_sound(s)
    assert all(0 <= t < 1 for t in s.blt[0]) and all(w >= 0 for w in s.blt[1])
    assert s.sensitivity == pytest.approx(dense_mse(s.column(), 40, 20)[0], rel=1e-10)


def test_entries_of_the_first_cache_version_are_not_read(tmp_path):
    key = {"kind": "banded", "steps": 2000, "bands": 2, "momentum": 0.0}
    poison(tmp_path, key, {"c": [1.0, 2.6964908786364485e+184]}, version=1)  # what version 1 stored
    s = make_strategy("banded", steps=2000, bands=2, cache_dir=tmp_path)
    assert_sound(s) and s.coefficients[1] < 1


def test_an_invalid_optimum_falls_back_to_identity_with_a_warning(tmp_path, monkeypatch):
    for bad in ([1.0, float("nan"), 0.1], [1.0, -0.99, 0.0]):  # non-finite; worse than C = I
        monkeypatch.setattr(strategy_search, "optimise_banded", lambda *args, bad=bad: bad)
        with pytest.warns(RuntimeWarning, match=r"steps=50, bands=3.*C = I"):
            s = make_strategy("banded", steps=50, bands=3, cache_dir=tmp_path)
        assert s.coefficients == (1.0, 0.0, 0.0) and s.mse_ratio == pytest.approx(1.0)
        assert s.sensitivity == 1.0 and s.bands == 3
    assert not list(tmp_path.iterdir())  # nothing cached


def test_no_valid_strategy_is_a_clear_error(tmp_path, monkeypatch):
    refused = strategy_validation.Defect.NOT_FINITE
    monkeypatch.setattr(strategy_validation, "defect", lambda *args, **kwargs: refused)
    with pytest.raises(strategy_validation.StrategyError,
                       match=r"steps=100, buffers=4, period=20.*'independent'") as info:
        make_strategy("blt", steps=100, period=20, cache_dir=tmp_path)
    assert info.value.defect is refused


def train(mechanism, samples, batch, epochs, **options):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(samples, 4), torch.randint(0, 2, (samples,)))
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=batch), noise_multiplier=1.0, max_grad_norm=1.0,
            noise_mechanism=mechanism, epochs=epochs, **options)
    for step, (x, y) in enumerate(loader):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == 4:
            break
    return optimizer.noise.strategy, model


@pytest.mark.parametrize("mechanism, samples, batch, epochs, options", [
    ("blt", 160, 8, 5, {}),               # 20 steps per pass, 100 planned steps
    ("banded", 200, 2, 4, {"bands": 2}),  # 100 steps per pass, 400 planned steps
])
def test_private_training_gets_a_finite_strategy(mechanism, samples, batch, epochs, options):
    strategy, model = train(mechanism, samples, batch, epochs, **options)
    assert_sound(strategy)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cache_reads_and_writes_only_finite_numbers(tmp_path):
    key = {"kind": "banded", "steps": 5, "bands": 2, "momentum": 0.0}
    for i, bad in enumerate(({"c": [1.0, float("inf")]}, {"c": [True, 0.5]}, {"c": []}, {}, {"c": [[1.0]]})):
        folder = tmp_path / str(i)
        folder.mkdir()
        cache.store(key, bad, folder)
        assert not list(folder.iterdir())
        poison(folder, key, bad)
        assert cache.load(key, folder) is None
        cache.store(key, {"c": [1.0, 0.5]}, folder)  # replaces the bad entry
        assert cache.load(key, folder) == {"c": [1.0, 0.5]}


def test_reflection_coefficients_inside_the_unit_interval_give_a_stable_inverse():
    rng = np.random.default_rng(0)
    for size in (1, 2, 5, 9):
        k = torch.tensor(rng.uniform(-0.999, 0.999, size), dtype=torch.float64)
        c = toeplitz.from_reflection(k)
        assert c[0] == 1 and len(c) == size + 1
        assert np.abs(np.roots(c.numpy()[::-1])).min() > 1  # every root of c(x) outside the unit disk
        assert torch.allclose(toeplitz.to_reflection(c), k, atol=1e-9)
    with pytest.raises(ValueError, match="unit disk"):
        toeplitz.to_reflection([1.0, 2.0])
