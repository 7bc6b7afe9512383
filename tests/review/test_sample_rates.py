"""The sample rate the accountant records, in every way of building a private run.

Expected values by hand: q = 1/len(loader) for a loader the engine converts or keeps, the
loader's own q for a DPDataLoader, batch_size/sample_size (or sample_rate=) in the classic API,
and the logical (not physical) batch with BatchMemoryManager; one record per logical step.
"""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager, DPDataLoader, UniformWithReplacementSampler

from tests.review.helpers import loss_of, modern_engine, quiet, tiny_dataset, tiny_model

N = 40


def modern_history(loader, poisson, steps=2, physical=None):
    model = tiny_model()
    engine = modern_engine(accountant="rdp")
    gsm, optimizer, loader = quiet(
        engine.make_private, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson)
    if physical is not None:
        manager = BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer)
        loader = manager.__enter__()
    for x, y in loader:
        loss_of(gsm, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if len(engine.accountant) == steps:
            break
    return [tuple(h) for h in engine.accountant.history]


@pytest.mark.parametrize("poisson", [True, False])
@pytest.mark.parametrize("make_loader, q", [
    (lambda: DataLoader(tiny_dataset(N), batch_size=10), 0.25),
    (lambda: DataLoader(tiny_dataset(N), batch_size=16), 1 / 3),
    (lambda: DataLoader(tiny_dataset(N), batch_sampler=BatchSampler(SequentialSampler(range(N)), 8, False)), 0.2),
    (lambda: DPDataLoader(tiny_dataset(N), sample_rate=0.3), 0.3),
])
def test_modern_api_records_the_sample_rate_of_the_loader(make_loader, q, poisson):
    assert modern_history(make_loader(), poisson) == [(1.0, q, 2)]


@pytest.mark.parametrize("poisson", [True, False])
def test_batch_memory_manager_records_logical_steps_at_the_logical_rate(poisson):
    assert modern_history(DataLoader(tiny_dataset(N), batch_size=10), poisson, physical=3) == [(1.0, 0.25, 2)]


@pytest.mark.parametrize("kwargs, q", [
    (dict(batch_size=8, sample_size=N), 0.2),
    (dict(sample_rate=0.125), 0.125),
    (dict(batch_size=5, sample_size=N, sample_rate=0.125, poisson=True), 0.125),
])
def test_classic_api_records_its_declared_sample_rate(kwargs, q):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = quiet(PrivacyEngine, model, noise_multiplier=1.0, max_grad_norm=1.0, **kwargs)
    quiet(engine.attach, optimizer)
    data = tiny_dataset(N)
    if "batch_size" in kwargs and not kwargs.get("poisson", False):
        loader = DataLoader(data, batch_size=kwargs["batch_size"], shuffle=True)
    else:
        loader = DataLoader(data, batch_sampler=UniformWithReplacementSampler(num_samples=N, sample_rate=q))
    for x, y in loader:
        loss_of(model, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert engine.accountant.history == [(1.0, q, len(loader))]
