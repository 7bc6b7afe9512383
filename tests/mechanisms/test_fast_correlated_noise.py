"""Correlated noise (banded, BLT, tree) drawn by the fast generators (``fast_noise=True`` and
``"philox"``): each mechanism is its recursion over that generator's draws, a private run's noise
whitened by the mechanism's ``C`` is i.i.d. ``N(0, (σ·C_clip·Δ)²)``, another stream than the
default one, and a run resumed from a checkpoint is the uninterrupted run, bit for bit."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.mechanisms.noise import CorrelatedNoise, recursion_for
from opacus_dp.optim.parallel_noise import ParallelGaussianNoise
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise
from tests.integrations.noise_statistics import assert_standard_normal, assert_uncorrelated, flat_parameters
from tests.mechanisms.test_noise import run
from tests.mechanisms.test_noise_protocol import STEPS, c_inverse, strategy_of, stream

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")

FAST = {True: ParallelGaussianNoise, "philox": PhiloxGaussianNoise}
MECHANISMS = ("banded", "blt", "tree")
SIGMA, LR, SAMPLES, BATCH, EPOCHS = 1e4, 1e-4, 120, 12, 2


@pytest.mark.parametrize("fast_noise", FAST)
@pytest.mark.parametrize("kind", MECHANISMS)
def test_each_mechanism_is_its_recursion_over_the_fast_draws(kind, fast_noise, tmp_path):
    strategy, draws_of = strategy_of(kind, tmp_path), FAST[fast_noise]
    got = run(CorrelatedNoise(strategy, draws_of(seed=6)), STEPS)
    expected = stream(recursion_for(strategy), run(draws_of(seed=6), STEPS, std=strategy.sensitivity))
    assert all(torch.equal(a, b) for step_got, step_expected in zip(got, expected)
               for a, b in zip(step_got, step_expected))


def private(kind, fast_noise, secure_mode=False):
    """``(engine, model, optimizer, loader)``: a 2-layer MLP (450 parameters) trained with the
    mechanism for ``EPOCHS`` epochs of cyclic Poisson batches of expected size ``BATCH``."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 4), torch.randint(0, 2, (SAMPLES,)))
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    extra = {"bands": 4} if kind == "banded" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(secure_mode=secure_mode)
        made = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                   data_loader=DataLoader(data, batch_size=BATCH), noise_multiplier=SIGMA,
                                   max_grad_norm=1.0, noise_mechanism=kind, epochs=EPOCHS,
                                   fast_noise=fast_noise, **extra)
    return (engine, *made)


def step(model, optimizer, batch) -> None:
    x, y = batch
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def whitened_noise(kind, fast_noise, secure_mode=False) -> torch.Tensor:
    """``w = C z / (σ·C_clip·Δ)`` over the run's steps × parameters, where ``z_t`` is step ``t``'s
    noise recovered from the update ``−lr·(clipped sum + z_t)/B`` (the clipped sum, of norm at
    most ``B``, vanishes beside ``σ = 10⁴``)."""
    engine, model, optimizer, loader = private(kind, fast_noise, secure_mode)
    noises = []
    for _ in range(EPOCHS):
        for batch in loader:
            before = flat_parameters(model)
            step(model, optimizer, batch)
            after = flat_parameters(model)
            noises.append((before - after).double() * optimizer.expected_batch_size / LR)
    strategy = optimizer.noise.strategy
    z = torch.stack(noises)
    assert z.shape[0] == strategy.steps == len(engine.accountant)
    w = torch.linalg.solve(c_inverse(strategy, z.shape[0]), z)
    return w / (SIGMA * strategy.sensitivity)


@pytest.mark.parametrize("fast_noise", FAST)
@pytest.mark.parametrize("kind", MECHANISMS)
def test_a_private_run_adds_the_mechanisms_noise_from_another_stream(kind, fast_noise):
    w = whitened_noise(kind, fast_noise)
    assert_standard_normal(w, f"{kind}, fast_noise={fast_noise!r}")
    assert_uncorrelated(w, whitened_noise(kind, False), f"{kind}: fast_noise={fast_noise!r} against the default")


@pytest.mark.parametrize("kind", MECHANISMS)
def test_secure_philox_runs_are_keyed_by_the_os(kind):
    first, second = whitened_noise(kind, "philox", secure_mode=True), whitened_noise(kind, "philox", secure_mode=True)
    assert_standard_normal(first, f"secure {kind}")
    assert_uncorrelated(first, second, f"secure {kind}: two runs from the same seeds")


@pytest.mark.parametrize("fast_noise", FAST)
@pytest.mark.parametrize("kind", MECHANISMS)
def test_a_resumed_run_is_the_uninterrupted_run(kind, fast_noise, tmp_path):
    """The resumed run takes the batches the uninterrupted one took after the checkpoint."""
    engine, model, optimizer, loader = private(kind, fast_noise)
    later = []
    for _ in range(EPOCHS):
        for batch in loader:  # each batch is followed by its step
            if len(engine.accountant) == 5:
                engine.save_checkpoint(path=tmp_path / "ckpt.pt", module=model, optimizer=optimizer)
            if len(engine.accountant) >= 5:
                later.append(batch)
            step(model, optimizer, batch)
    assert len(later) == len(engine.accountant) - 5 > 0
    resumed_engine, resumed, resumed_optimizer, _ = private(kind, fast_noise)
    resumed_engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=resumed, optimizer=resumed_optimizer)
    for batch in later:
        step(resumed, resumed_optimizer, batch)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    assert resumed_engine.accountant.history == engine.accountant.history
    _, other, other_optimizer, _ = private(kind, "philox" if fast_noise is True else True)
    with pytest.raises(ValueError, match="resume with the saved run's setting"):
        resumed_engine.load_checkpoint(path=tmp_path / "ckpt.pt", module=other, optimizer=other_optimizer)
