"""torch's global RNG: Opacus 1.6 draws nothing from it in ``make_private`` and draws batches and
noise from it as training goes; opacus_dp draws two seeds at ``make_private`` and nothing after
(its loader and noise have their own, checkpointable generators: docs/migration.md)."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine

# the engines these tests build never take a step that needs secure noise
pytestmark = [pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice"),
              pytest.mark.filterwarnings("ignore:Secure RNG turned off")]


def _rng_state_moved_by_make_private(engine_class):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    engine = engine_class(accountant="rdp")
    before = torch.random.get_rng_state()
    engine.make_private(module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0,
                        max_grad_norm=1.0)
    return not torch.equal(before, torch.random.get_rng_state())


def test_opacus_reference_draws_nothing_in_make_private():
    opacus = pytest.importorskip("opacus")
    if opacus.__name__ != "opacus":
        pytest.skip("the opacus alias is active in this process")
    assert not _rng_state_moved_by_make_private(opacus.PrivacyEngine)


def test_make_private_draws_exactly_two_seeds_from_the_global_rng_and_nothing_per_step():
    """The documented difference (docs/migration.md): the Poisson loader's generator, then the
    noise generator, are seeded from two draws of the global RNG at ``make_private``; training then
    draws nothing from it (Opacus instead draws every batch and every noise tensor from it)."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    before = torch.random.get_rng_state()
    engine = PrivacyEngine(accountant="rdp")
    private, optimizer, private_loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
        noise_multiplier=1.0, max_grad_norm=1.0)
    after_setup = torch.random.get_rng_state()
    torch.random.set_rng_state(before)
    torch.empty((), dtype=torch.int64).random_()  # the loader's seed (data/samplers.py)
    torch.randint(0, 2**62, (1,))  # the noise's seed (optim/noise.py)
    assert torch.equal(torch.random.get_rng_state(), after_setup)
    for x, y in private_loader:
        torch.nn.functional.cross_entropy(private(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert torch.equal(torch.random.get_rng_state(), after_setup)
