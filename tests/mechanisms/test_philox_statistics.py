"""Philox Gaussian noise, seeded statistics with stated tolerances: moments, Kolmogorov–Smirnov,
tail frequencies, the radius bound, the Box-Muller pairs (uniform angle, exponential squared
radius, even quadrants), correlations of neighbours, tensors, steps and rank streams, secure
mode, and the torch reference path (same numbers, with a warning)."""

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from opacus_dp.distributed.noise_streams import give_rank_its_stream
from opacus_dp.optim.philox import draws, native
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise

CPU = torch.device("cpu")
N = 3 * 2 ** 20 + 123  # not a multiple of a tile
STD = 1.7


def first_draws(noise, *sizes, std=STD):
    noise.begin_step(CPU)
    return [noise.sample(torch.empty(size), std) for size in sizes]


def correlation(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel())[0, 1])


def check_moments(z: np.ndarray) -> None:
    """Standard normal ``z``: mean, std and kurtosis within five standard errors."""
    n = z.size
    assert abs(z.mean()) < 5 / math.sqrt(n)
    assert abs(z.std() - 1) < 5 / math.sqrt(2 * n)
    assert abs(stats.kurtosis(z, fisher=False) - 3) < 5 * math.sqrt(24 / n)


@pytest.fixture(scope="module")
def z():
    x, = first_draws(PhiloxGaussianNoise(seed=2024, num_threads=2), N)
    assert x.dtype == torch.float32 and x.shape == (N,)
    return x.double().numpy() / STD


@pytest.fixture
def deterministic_os_keys(monkeypatch):
    keys = random.Random(12345)
    monkeypatch.setattr("opacus_dp.optim.parallel_noise.secrets.randbits", keys.getrandbits)


def test_mean_std_and_kurtosis(z):
    check_moments(z)
    assert 5 / math.sqrt(2 * N) < 0.003  # a 0.3 % error of the scale would fail


def test_kolmogorov_smirnov_accepts_the_draws_and_rejects_a_wrong_scale(z):
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z, "norm", args=(0.0, 1.01)).pvalue < 1e-6  # the test has power
    for part in np.array_split(z, 4):
        assert stats.kstest(part, "norm").pvalue > 1e-3


@pytest.mark.parametrize("k", [2, 3, 4])
def test_tail_frequencies_are_gaussian(z, k):
    p = 2 * stats.norm.sf(k)
    frequency = float(np.mean(np.abs(z) > k))
    assert abs(frequency - p) < 5 * math.sqrt(p * (1 - p) / N), (frequency, p)


def test_every_draw_is_within_the_documented_bound(z):
    biggest = float(np.abs(z).max())
    assert biggest <= 6.67
    assert biggest > 4.5  # 3 M draws reach beyond 4.5 sigma (P(max < 4.5) < 1e-8)


def box_muller_pairs(z):
    """The (cos, sin) pairs of kernel.c: planes 0 and 1, planes 2 and 3 of each tile of 256."""
    tiles = z[:len(z) // 256 * 256].reshape(-1, 4, 64)
    return (np.concatenate([tiles[:, 0], tiles[:, 2]]).ravel(),
            np.concatenate([tiles[:, 1], tiles[:, 3]]).ravel())


def test_box_muller_pairs_have_uniform_angle_and_exponential_radius(z):
    c, s = box_muller_pairs(z)
    angle, radius2 = np.arctan2(s, c), c * c + s * s
    assert stats.kstest(angle, "uniform", args=(-math.pi, 2 * math.pi)).pvalue > 1e-3
    assert stats.kstest(radius2, "expon", args=(0.0, 2.0)).pvalue > 1e-3
    assert stats.kstest(radius2, "expon", args=(0.0, 2.02)).pvalue < 1e-6  # the test has power
    assert abs(correlation(c, s)) < 5 / math.sqrt(c.size)
    assert abs(correlation(c * c, s * s)) < 5 / math.sqrt(c.size)


@pytest.mark.parametrize("layout", ["box-muller pairs", "consecutive pairs"])
def test_the_four_quadrants_are_used_evenly(z, layout):
    a, b = box_muller_pairs(z) if layout == "box-muller pairs" else (z[0:-1:2], z[1::2])
    quadrant = (a < 0).astype(int) * 2 + (b < 0).astype(int)
    counts = np.bincount(quadrant, minlength=4)
    m = quadrant.size
    assert np.all(np.abs(counts - m / 4) < 5 * math.sqrt(m * 3 / 16)), counts
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("lag", [1, 2, 63, 64, 65, 128, 192, 256, 16384])
def test_neighbours_are_uncorrelated(z, lag):
    """Lag 64 and 128 pair coordinates of one Philox block, lag 256 neighbouring tiles."""
    bound = 5 / math.sqrt(N - lag)
    assert abs(correlation(z[:-lag], z[lag:])) < bound
    assert abs(correlation(z[:-lag] ** 2, z[lag:] ** 2)) < bound


def test_tensors_steps_and_rank_streams_are_uncorrelated():
    n = 2 ** 20 + 17
    noise = PhiloxGaussianNoise(seed=77)
    slot0, slot1 = first_draws(noise, n, n)
    step1, = first_draws(noise, n)
    ranks = []
    for rank in (0, 1):
        rank_noise = PhiloxGaussianNoise(seed=77)
        give_rank_its_stream(rank_noise, rank)
        ranks.append(first_draws(rank_noise, n)[0])
    other_key, = first_draws(PhiloxGaussianNoise(seed=78), n)
    pairs = {"slots": (slot0, slot1), "steps": (slot0, step1), "ranks": tuple(ranks),
             "keys": (slot0, other_key), "rank and base": (ranks[0], slot0)}
    for name, (a, b) in pairs.items():
        assert not torch.equal(a, b), name
        assert abs(correlation(a, b)) < 5 / math.sqrt(n), name
        assert abs(correlation(a[1:], b[:-1])) < 5 / math.sqrt(n), name
    for x in (slot0, slot1, step1, other_key, *ranks):
        check_moments(x.double().numpy() / STD)


@pytest.mark.usefixtures("deterministic_os_keys")
def test_secure_mode_has_the_right_scale_and_fresh_noise():
    """Each coordinate sums four draws of std/2: its std is std."""
    n, std = 2 ** 21, 2.5
    noise = PhiloxGaussianNoise(secure_mode=True, num_threads=2)
    first, = first_draws(noise, n, std=std)
    second, = first_draws(noise, n, std=std)
    other, = first_draws(PhiloxGaussianNoise(secure_mode=True), n, std=std)
    for x in (first, second, other):
        scaled = x.double().numpy() / std
        check_moments(scaled)
        assert stats.kstest(scaled, "norm").pvalue > 1e-3
    for a, b in ((first, second), (first, other)):
        assert abs(correlation(a, b)) < 5 / math.sqrt(n)


@pytest.fixture
def reference_only(monkeypatch):
    """The torch reference path, the warning not yet given in this process."""
    monkeypatch.setenv("OPACUS_DP_NATIVE", "0")
    monkeypatch.setattr(draws, "_warned", False)
    native.forget()
    yield
    native.forget()  # the next kernel() loads the native kernel again


def native_draws(n):
    native.forget()
    if native.kernel() is None:
        return None
    return first_draws(PhiloxGaussianNoise(seed=99), n, n)


def test_reference_path_warns_and_draws_the_native_numbers(request):
    n = 2 ** 19 + 300
    expected = native_draws(n)
    request.getfixturevalue("reference_only")
    assert native.kernel() is None and native.unavailable_reason() == "OPACUS_DP_NATIVE=0"
    with pytest.warns(RuntimeWarning, match=r"native Philox noise kernel is not available \(OPACUS_DP_NATIVE=0\)"):
        drawn = first_draws(PhiloxGaussianNoise(seed=99), n, n)
    for x in drawn:
        scaled = x.double().numpy() / STD
        check_moments(scaled)
        assert stats.kstest(scaled, "norm").pvalue > 1e-3
    assert abs(correlation(*drawn)) < 5 / math.sqrt(n)
    if expected is None:
        pytest.skip(f"native Philox kernel unavailable: {native.unavailable_reason()}")
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))
