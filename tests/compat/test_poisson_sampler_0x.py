"""Opacus 0.x's Poisson loader: ``DataLoader(dataset, batch_sampler=UniformWithReplacementSampler(...))``
with torch's default collate, and the classic ``PrivacyEngine(..., poisson=True)``.

As in Opacus 0.15 the sampler never yields an empty draw (the default collate fails on ``[]``);
every draw is still one accounted step: the engine following the sampler's rate takes the
empty draw's step (noise only) when it is drawn.
"""

import gc
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import RDPAccountant
from opacus_dp.data import SamplingWarning
from opacus_dp.data.empty_draw_steps import follow_empty_draws
from opacus_dp.utils.uniform_sampler import UniformWithReplacementSampler

N, Q, SEED, EPOCHS, SIGMA = 8, 0.13, 2, 4, 1.0  # 0.87^8 ≈ 0.33 of the draws are empty
ALPHAS = [2, 4, 8, 16, 32, 64]


@pytest.fixture(autouse=True)
def _no_engines_of_earlier_tests():
    gc.collect()  # engines never detached follow empty draws until they are collected
    yield


def dataset():
    return TensorDataset(torch.randn(N, 4), torch.randint(0, 2, (N,)))


def drawn_batches():
    """Every draw of the seeded sampler, empty ones included, for EPOCHS passes."""
    sampler = UniformWithReplacementSampler(num_samples=N, sample_rate=Q, skip_empty=False,
                                            generator=torch.Generator().manual_seed(SEED))
    return [batch for _ in range(EPOCHS) for batch in sampler]


def loader_0x(data):
    sampler = UniformWithReplacementSampler(num_samples=N, sample_rate=Q,
                                            generator=torch.Generator().manual_seed(SEED))
    return DataLoader(data, batch_sampler=sampler)  # torch's default collate


def classic_engine(model, poisson=True):
    """The 0.x engine; with ``poisson=False`` it does not follow empty draws itself (the tests
    of the follower attach one)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, sample_rate=Q, sample_size=N, alphas=ALPHAS,
                               noise_multiplier=SIGMA, max_grad_norm=1.0, poisson=poisson)
        engine.attach(optimizer)
    return engine, optimizer


def train(model, optimizer, loader):
    sizes = []
    for _ in range(EPOCHS):
        for x, y in loader:
            sizes.append(len(x))
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    return sizes


def hand_built_history(draws):
    """One (σ, q) record per drawn batch, empty ones included."""
    accountant = RDPAccountant(alphas=ALPHAS)
    for _ in draws:
        accountant.step(noise_multiplier=SIGMA, sample_rate=Q)
    return accountant


def test_default_collate_never_receives_an_empty_draw():
    data, draws = dataset(), drawn_batches()
    assert any(len(b) == 0 for b in draws), "the seed must draw empty batches"
    loader = loader_0x(data)
    with pytest.warns(SamplingWarning, match="no privacy engine follows"):
        batches = [x for _ in range(EPOCHS) for x, _ in loader]
    expected = [data.tensors[0][b] for b in draws if b]
    assert len(batches) == len(expected) < len(draws)
    assert all(torch.equal(a, b) for a, b in zip(batches, expected))


def test_unfollowed_empty_draws_warn_once_per_sampler():
    sampler = UniformWithReplacementSampler(num_samples=2, sample_rate=0.01, steps=50)
    with pytest.warns(SamplingWarning) as record:
        list(sampler)
        list(sampler)
    assert len([w for w in record if issubclass(w.category, SamplingWarning)]) == 1


def test_each_empty_draw_is_a_noise_only_step_and_accounted():
    model = nn.Linear(4, 2)
    engine, optimizer = classic_engine(model, poisson=False)
    handle = follow_empty_draws(optimizer, sample_rate=engine.sample_rate)
    updates = []
    model.register_forward_pre_hook(lambda *_: updates.append(model.weight.detach().clone()))
    try:
        sizes = train(model, optimizer, loader_0x(dataset()))
    finally:
        handle.remove()
    draws = drawn_batches()
    assert 0 not in sizes and len(sizes) == sum(1 for b in draws if b)
    reference = hand_built_history(draws)
    assert engine.accountant.history == reference.history == [(SIGMA, Q, len(draws))]
    assert engine.get_privacy_spent(1e-5)[0] == reference.get_privacy_spent(delta=1e-5, alphas=ALPHAS)[0]
    assert all(not torch.equal(a, b) for a, b in zip(updates, updates[1:]))  # noise in every step


def test_a_removed_follower_takes_no_step():
    model = nn.Linear(4, 2)
    engine, optimizer = classic_engine(model, poisson=False)
    follow_empty_draws(optimizer, sample_rate=engine.sample_rate).remove()
    with pytest.warns(SamplingWarning, match="no privacy engine follows"):
        sizes = train(model, optimizer, loader_0x(dataset()))
    assert engine.steps == len(sizes)


def test_an_empty_step_leaves_grad_as_it_was():
    model = nn.Linear(4, 2)
    engine, optimizer = classic_engine(model, poisson=False)
    handle = follow_empty_draws(optimizer, sample_rate=engine.sample_rate)
    sampler = UniformWithReplacementSampler(num_samples=1, sample_rate=Q, steps=1,
                                            generator=torch.Generator().manual_seed(0))  # U ≥ q
    before = model.weight.detach().clone()
    try:
        assert list(sampler) == [] and engine.steps == 1
    finally:
        handle.remove()
    assert model.weight.grad is None and not torch.equal(before, model.weight)


def test_classic_poisson_engine_accounts_every_draw_of_a_0x_loader():
    model = nn.Linear(4, 2)
    engine, optimizer = classic_engine(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SamplingWarning)  # every empty draw is followed
        train(model, optimizer, loader_0x(dataset()))
    engine.detach()
    draws = drawn_batches()
    assert engine.accountant.history == hand_built_history(draws).history


def test_modern_engine_refuses_a_0x_sampler_that_would_skip_unaccounted_empty_draws():
    """With poisson_sampling=False the modern engine does not follow the sampler's empty draws:
    taking the loader as it is would leave them out of the accounting (epsilon under-reported)."""
    from opacus_dp import PrivacyEngine

    model = nn.Linear(4, 2)
    sampler = UniformWithReplacementSampler(num_samples=8, sample_rate=0.1,
                                            generator=torch.Generator().manual_seed(0))
    loader = DataLoader(dataset(), batch_sampler=sampler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
    with pytest.raises(ValueError, match="skips empty draws.*poisson_sampling=True"):
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                            poisson_sampling=False)
