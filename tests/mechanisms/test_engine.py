"""Cyclic Poisson sampling, the engine's wiring and its refusals."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.data import BatchMemoryManager
from opacus_dp.errors import PrivacyBudgetExceededError
from opacus_dp.data.cyclic_sampler import CyclicPoissonSampler
from opacus_dp.mechanisms.noise import CorrelatedNoise

# engines without secure_mode (a reminder tested in tests/engine/test_secure_mode_notice.py)
pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


def test_cyclic_sampler_partitions_and_samples_the_group_of_the_step():
    sampler = CyclicPoissonSampler(103, groups=4, group_rate=0.5, generator=torch.Generator().manual_seed(0), steps=10)
    assert len(sampler) == 12  # a multiple of the groups
    groups = [set(sampler.group_of(g).tolist()) for g in range(4)]
    assert sum(len(g) for g in groups) == 103 and set().union(*groups) == set(range(103))
    longer = CyclicPoissonSampler(2000, groups=4, group_rate=0.5)
    assert torch.equal(longer.assignment[:103], sampler.assignment)  # one more example moves nobody
    counts = torch.zeros(103)
    for _ in range(50):
        for step, batch in enumerate(sampler):
            assert set(batch) <= groups[step % 4]
            counts[batch] += 1
    assert float(counts.mean()) == pytest.approx(50 * 3 * 0.5, rel=0.05)  # 3 rounds per pass
    assert abs(sum(len(g) for g in groups[:2]) - 51.5) < 20  # uniform assignment
    same = CyclicPoissonSampler(103, groups=4, group_rate=0.5, steps=10)
    assert all(torch.equal(a, b) for a, b in zip(sampler.partition, same.partition))


def test_cyclic_sampler_shares_one_global_batch_among_ranks():
    draws = [list(CyclicPoissonSampler(50, groups=2, group_rate=0.6, generator=torch.Generator().manual_seed(1),
                                       rank=r, num_replicas=2)) for r in range(2)]
    single = list(CyclicPoissonSampler(50, groups=2, group_rate=0.6, generator=torch.Generator().manual_seed(1)))
    for a, b, whole in zip(*draws, single):
        assert not set(a) & set(b) and sorted(a + b) == sorted(whole)


def make(mechanism="banded", **kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(120, 4), torch.randint(0, 2, (120,)))
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    options = dict(noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism=mechanism, epochs=2)
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine()
        return (engine, *engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                             data_loader=DataLoader(data, batch_size=12), **options))


def test_loaders_whose_sampling_would_be_lost_are_refused():
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    weighted = DataLoader(data, batch_size=4, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 40, 40))
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="weights the examples"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=weighted, noise_multiplier=1.0, max_grad_norm=1.0,
                                     noise_mechanism="banded", bands=2, epochs=1)
    engine, model, opt, loader = make(bands=2)
    with pytest.raises(ValueError, match="already a cyclic Poisson loader"):
        other = nn.Linear(4, 2)
        PrivacyEngine().make_private(module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                                     noise_mechanism="banded", bands=2, epochs=1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(poisson_sampling=False), "poisson_sampling=True"),
    (dict(clipping="adaptive"), "adaptive"),
    (dict(bands=11), "exceeds"),
    (dict(epochs=None), "epochs"),
    (dict(bands=None), "bands must be"),
])
def test_requests_the_analysis_does_not_cover_are_refused(kwargs, match):
    options = dict(bands=3)
    options.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make(**options)
    with pytest.raises(ValueError, match="bands only apply"):
        make("blt", bands=2)
    with pytest.raises(ValueError, match="noise_mechanism must be"):
        make("tree-of-life")


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_every_grad_sample_mode_trains_with_banded_noise(mode):
    engine, model, opt, *rest = make(bands=2, grad_sample_mode=mode)
    loader = rest[-1]
    criterion = rest[0] if mode == "ghost" else nn.CrossEntropyLoss()
    assert isinstance(opt.noise, CorrelatedNoise) and opt.expected_batch_size == 12
    for x, y in loader:
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert len(engine.accountant) == len(loader) == 10
    assert [entry[1] for entry in engine.accountant.history] == [0.2, 0.0] * 5
    assert opt.noise.step_index == 9


def test_batch_memory_manager_takes_one_noise_step_per_logical_batch():
    engine, model, opt, loader = make(bands=2)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=opt) as physical:
        for x, y in physical:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert opt.noise.step_index == 9 and len(engine.accountant) == 10


@pytest.mark.parametrize("mechanism", ["blt", "tree"])
def test_checkpoint_restores_the_noise_buffers(tmp_path, mechanism):
    engine, model, opt, loader = make(mechanism)
    for step, (x, y) in enumerate(loader):  # each batch is followed by its step
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            break
    engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=opt)
    saved_buffers = [t.clone() for t in opt.noise.state_dict()["buffers"][0]]
    engine2, model2, opt2, loader2 = make(mechanism)
    engine2.load_checkpoint(path=tmp_path / "ckpt.pt", module=model2, optimizer=opt2)
    assert opt2.noise.step_index == 3
    assert all(torch.equal(a, b) for a, b in zip(opt2.noise.state_dict()["buffers"][0], saved_buffers))
    for o, m, dl in ((opt, model, loader), (opt2, model2, loader2)):
        x, y = next(iter(dl))  # the batch of step 4 (group 4, taken whole)
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_budget_guard_charges_the_reduction():
    """max_epsilon = ε after 3 rounds of b = 2: the guard lets the 6 steps through (the free
    steps cost nothing) and refuses the 7th, which would start a 4th round."""
    engine, model, opt, loader = make(bands=2)
    ceiling = PrivacyEngine()
    ceiling.accountant.history = [(1.0, 0.2, 3)]
    limit = ceiling.get_epsilon(1e-5) * (1 + 1e-9)
    engine2 = PrivacyEngine(max_epsilon=limit, max_epsilon_delta=1e-5)
    torch.manual_seed(0)
    model2 = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model2, opt2, loader2 = engine2.make_private(
            module=model2, optimizer=torch.optim.SGD(model2.parameters(), lr=0.1), data_loader=DataLoader(loader.dataset, batch_size=12),
            noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="banded", bands=2, epochs=2)
    taken = 0
    with pytest.raises(PrivacyBudgetExceededError):
        for x, y in loader2:
            nn.functional.cross_entropy(model2(x), y).backward()
            opt2.step()
            opt2.zero_grad()
            taken += 1
    assert taken == 6 and opt2.noise.step_index == 5


def test_budget_guard_stays_cheap_between_rounds():
    """Free steps do not invalidate the guard's cache (one search, not one per step)."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(400, 4), torch.randint(0, 2, (400,)))
    model = nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(max_epsilon=50.0, max_epsilon_delta=1e-5)
        model, opt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(data, batch_size=10),
            noise_multiplier=1.0, max_grad_norm=1.0, noise_mechanism="banded", bands=4, epochs=1)
    for x, y in loader:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    guard = next(h for h in opt._pre_step_hooks.values() if isinstance(h, BudgetGuard))
    assert len(engine.accountant) == 40 and guard.evaluations <= 40
