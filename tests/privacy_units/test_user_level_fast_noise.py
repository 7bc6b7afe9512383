"""User-level DP-SGD with the fast generators (``fast_noise=True``, ``"philox"``): each step adds
``N(0, σ²C²)`` to the sum of the users' clipped gradients, divided by the expected number of users,
from another stream than the default one, and secure mode keys it from the operating system."""

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from opacus_dp import PrivacyEngine
from tests.integrations.noise_statistics import assert_standard_normal, assert_uncorrelated, flat_parameters
from tests.privacy_units.models import make_data, make_model

SIGMA, CLIP, LR, STEPS = 1e4, 1.0, 1e-4, 6

pytestmark = pytest.mark.filterwarnings("ignore::opacus_dp.engine.private_step.SecureModeNotice")


def step_noise(mode: str, fast_noise, secure_mode: bool = False) -> torch.Tensor:
    """``z_t = −Δθ_t·B/(lr·σ·C)`` over ``STEPS`` steps × 939 parameters, ``B`` the expected number of
    users per step: the noise of each step in units of its std (the users' clipped sum, of norm at
    most ``B·C``, vanishes beside ``σ = 10⁴``)."""
    dataset, users = make_data("wide_sequence")
    model = make_model("wide_sequence")
    torch.manual_seed(3)
    out = PrivacyEngine(accountant="rdp", secure_mode=secure_mode).make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        data_loader=DataLoader(dataset, batch_size=12), noise_multiplier=SIGMA, max_grad_norm=CLIP,
        grad_sample_mode=mode, privacy_unit="user", user_ids=users, max_examples_per_user=3,
        fast_noise=fast_noise)
    private, optimizer, loader = out[0], out[1], out[-1]
    noises = []
    while len(noises) < STEPS:
        for x, y in loader:
            before = flat_parameters(model)
            nn.functional.cross_entropy(private(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            after = flat_parameters(model)
            noises.append((before - after).double() * optimizer.expected_batch_size / (LR * SIGMA * CLIP))
            if len(noises) == STEPS:
                break
    return torch.stack(noises)


@pytest.mark.parametrize("mode", ["hooks", "bk"])
@pytest.mark.parametrize("fast_noise", [True, "philox"])
def test_each_step_adds_sigma_c_noise_from_another_stream(fast_noise, mode):
    z = step_noise(mode, fast_noise)
    assert_standard_normal(z, f"user-level {mode}, fast_noise={fast_noise!r}")
    assert_uncorrelated(z, step_noise(mode, False), f"user-level {mode}: fast_noise={fast_noise!r} against the default")


def test_secure_philox_is_keyed_by_the_os():
    first, second = step_noise("bk", "philox", secure_mode=True), step_noise("bk", "philox", secure_mode=True)
    assert_standard_normal(first, "secure user-level philox")
    assert_uncorrelated(first, second, "secure user-level philox: two runs from the same seeds")
