"""The classic engine recognises Opacus 0.14's Poisson loader.

``PrivacyEngine(model, sample_rate=q, ...)`` (``poisson`` left at False, no ``sample_size``)
attached while one ``UniformWithReplacementSampler`` of rate q is alive takes its batches for
what they are — Poisson draws of rate q over N = ``sampler.num_samples`` examples — and runs as
``poisson=True, sample_size=N``: the mean divides by q·N, every empty draw is an accounted
noise-only step, and nothing warns. Where it cannot be sure (two such samplers over different
N, several processes, a batch_size given, steps the sampler did not feed) it warns as before.
"""

import gc
import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import RDPAccountant
from opacus_dp.data import SamplingWarning
from opacus_dp.utils.uniform_sampler import UniformWithReplacementSampler

ALPHAS = [1.5, 2, 4, 8, 16, 32, 64]
# 0.x scripts leave secure_mode off (its reminder is tested in tests/engine/test_secure_mode_notice.py)
pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


@pytest.fixture(autouse=True)
def _no_samplers_or_engines_of_earlier_tests():
    gc.collect()
    yield
    gc.collect()


def _sampler(n, q, seed, skip_empty=True):
    return UniformWithReplacementSampler(num_samples=n, sample_rate=q, skip_empty=skip_empty,
                                         generator=torch.Generator().manual_seed(seed))


def _engine_0x(model, q, sigma, clip=1.0):
    """Opacus 0.14's example engine: sample_rate only, poisson at its default (False)."""
    return PrivacyEngine(model, sample_rate=q, alphas=ALPHAS, noise_multiplier=sigma, max_grad_norm=clip)


def _sampling_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, SamplingWarning)]


def test_sigma_zero_update_is_the_clipped_sum_over_q_times_n():
    n, q, clip, seed = 10, 0.3, 0.05, 0  # expected batch q·N = 3
    first = next(b for b in _sampler(n, q, seed, skip_empty=False))
    assert len(first) not in (0, 3), "the seed must draw a first batch whose size is not q·N"
    torch.manual_seed(1)
    x, y = torch.randn(n, 4), torch.randint(0, 2, (n,))
    loader = DataLoader(TensorDataset(x, y), batch_sampler=_sampler(n, q, seed))
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    # Oracle: per-sample gradients from one autograd pass per sample, flat clipping at C.
    clipped = [torch.zeros_like(p) for p in model.parameters()]
    for i in first:
        grads = torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]),
                                    list(model.parameters()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for acc, g in zip(clipped, grads):
            acc += factor * g
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine_0x(model, q, sigma=0.0, clip=clip)
        engine.attach(optimizer)
        xb, yb = next(iter(loader))
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    assert _sampling_warnings(caught) == []
    assert len(xb) == len(first)
    for p, p0, s in zip(model.parameters(), before, clipped):
        torch.testing.assert_close(p0 - p.detach(), s / (q * n), rtol=1e-5, atol=1e-7)


def test_epsilon_is_an_rdp_replay_of_every_draw_empty_ones_included():
    n, q, seed, epochs, sigma, delta = 8, 0.13, 2, 4, 1.0, 1e-5  # 0.87^8 ≈ 0.33 of draws empty
    every_draw = _sampler(n, q, seed, skip_empty=False)
    draws = [b for _ in range(epochs) for b in every_draw]
    assert any(len(b) == 0 for b in draws), "the seed must draw empty batches"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(n, 4), torch.randint(0, 2, (n,)))
    loader = DataLoader(data, batch_sampler=_sampler(n, q, seed))
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine_0x(model, q, sigma)
        engine.attach(optimizer)
        sizes = []
        for _ in range(epochs):
            for xb, yb in loader:
                sizes.append(len(xb))
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
    assert _sampling_warnings(caught) == []
    assert sizes == [len(b) for b in draws if b]  # the loop never sees an empty draw
    reference = RDPAccountant(alphas=ALPHAS)
    for _ in draws:
        reference.step(noise_multiplier=sigma, sample_rate=q)
    assert engine.steps == len(draws) > len(sizes)
    assert engine.get_privacy_spent(delta) == reference.get_privacy_spent(delta=delta, alphas=ALPHAS)


def test_two_live_samplers_of_the_rate_over_different_sizes_keep_the_warning():
    q = 0.25
    samplers = [_sampler(8, q, 0), _sampler(12, q, 0)]  # noqa: F841 (kept alive)
    model = nn.Linear(4, 2)
    engine = _engine_0x(model, q, sigma=1.0)
    with pytest.warns(SamplingWarning, match=r"poisson=True, sample_size=len\(dataset\)"):
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.poisson is False and engine.expected_batch_size is None


def test_a_sampler_of_another_rate_or_a_batch_size_is_not_taken():
    sampler = _sampler(8, 0.25, 0)  # noqa: F841 (kept alive)
    for kwargs in ({"sample_rate": 0.5}, {"batch_size": 2, "sample_size": 8}):
        model = nn.Linear(4, 2)
        engine = PrivacyEngine(model, noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)
        with pytest.warns(SamplingWarning, match="poisson=False"):
            engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        assert engine.poisson is False


def test_steps_the_recognised_sampler_did_not_feed_are_warned_about():
    """A live sampler of the rate that the loop does not iterate: warned at its first step."""
    q, n = 0.25, 8
    sampler = _sampler(n, q, 0)  # noqa: F841 (alive, never iterated)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine_0x(model, q, sigma=1.0)
        engine.attach(optimizer)
    assert _sampling_warnings(caught) == []
    with pytest.warns(SamplingWarning, match="poisson=False") as record:
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
            optimizer.step()
    assert len(_sampling_warnings(record)) == 1  # once


def test_detach_restores_the_settings_given():
    q, n = 0.25, 8
    sampler = _sampler(n, q, 0)  # noqa: F841 (kept alive)
    model = nn.Linear(4, 2)
    engine = _engine_0x(model, q, sigma=1.0)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.poisson is True and engine.sample_size == n
    assert math.isclose(engine.expected_batch_size, q * n)
    engine.detach()
    assert engine.poisson is False and engine.sample_size is None and engine.expected_batch_size is None


def test_a_sampler_created_after_attach_is_not_seen_and_says_so():
    q, n = 0.25, 8
    model = nn.Linear(4, 2)
    engine = _engine_0x(model, q, sigma=1.0)
    with pytest.warns(SamplingWarning, match="poisson=False"):
        engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.poisson is False


def test_several_processes_are_left_as_they_are():
    """With several processes one rank's sampler says nothing of the others': not recognised."""
    from opacus_dp.engine.classic_arguments import recognised_0x_sampler

    sampler = _sampler(8, 0.25, 0)
    given = dict(poisson=False, batch_size=None, sample_size=None, sample_rate=0.25)
    assert recognised_0x_sampler(world_size=1, **given) is sampler
    assert recognised_0x_sampler(world_size=2, **given) is None
    assert recognised_0x_sampler(world_size=1, **{**given, "sample_size": 9}) is None


@pytest.mark.parametrize("secure_rng", [False, True])
def test_secure_rng_draws_the_taken_samplers_batches_from_the_os_until_detach(secure_rng):
    """Oracle: the draws of the same sampler, seeded alike, alone. secure_rng=True replaces the
    seed the script gave the sampler while attached (as make_private does with the loader's
    generator); without it the seeded draws are kept. detach gives the sampler its generator back."""
    n, q, seed = 64, 0.25, 3
    seeded = list(_sampler(n, q, seed))
    sampler = _sampler(n, q, seed)
    given = sampler.generator
    model = nn.Linear(4, 2)
    engine = PrivacyEngine(model, sample_rate=q, alphas=ALPHAS, noise_multiplier=1.0, max_grad_norm=1.0,
                           secure_rng=secure_rng)
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    drawn = list(sampler)
    assert (drawn != seeded) == secure_rng
    engine.detach()
    assert sampler.generator is given
