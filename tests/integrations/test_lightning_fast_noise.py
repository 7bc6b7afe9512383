"""``DPCallback(fast_noise=...)``: the noise generators of ``make_private`` through Lightning.

Oracles: each step's noise, the update less the clipped sum of an autograd loop over single
examples, is ``N(0, 1)`` after division by ``σ·C`` (Kolmogorov-Smirnov), and another stream than
the default generator's; a resumed run equals the uninterrupted one.
"""

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from opacus_dp.integrations.lightning import DPCallback  # noqa: E402
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise  # noqa: E402
from tests.integrations.lightning_support import BATCH, LR, N, Recorder, SaveAt, clipped_sum, data, fit  # noqa: E402
from tests.integrations.noise_statistics import assert_standard_normal, assert_uncorrelated  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

SIGMA, BOUND = 1.0, 1.0
Q = BATCH / N  # 4 steps per epoch


def run(fast_noise, epochs=2, savers=(), ckpt_path=None):
    pl.seed_everything(0)
    module = Recorder(*data())
    dp = DPCallback(target_delta=1e-5, max_grad_norm=BOUND, noise_multiplier=SIGMA, accountant="rdp",
                    fast_noise=fast_noise)
    fit(module, [dp, *savers], ckpt_path=ckpt_path, epochs=epochs, enable_checkpointing=bool(savers or ckpt_path))
    return module, dp


def noise_of_steps(module) -> torch.Tensor:
    """``z`` of every step: ``p' = p − LR·(S + σC·z)/L``, ``S`` from the per-example oracle, ``L`` = BATCH."""
    after = [params for params, _, _ in module.records[1:]] + [[p.detach() for p in module.net.parameters()]]
    draws = []
    for (before, x, y), result in zip(module.records, after):
        sums = clipped_sum(before, x, y, BOUND)
        for p0, s, p1 in zip(before, sums, result):
            draws.append(((p0.double() - p1.double()) * BATCH / LR - s).flatten() / (SIGMA * BOUND))
    return torch.cat(draws)


def test_philox_noise_of_the_steps_is_gaussian_and_not_the_default_stream():
    philox_module, dp = run("philox", epochs=6)
    assert isinstance(dp.optimizer.noise, PhiloxGaussianNoise)
    default_module, _ = run(False, epochs=6)
    philox, default = noise_of_steps(philox_module), noise_of_steps(default_module)
    steps = 6 * round(1 / Q)
    assert philox.numel() == default.numel() == steps * sum(p.numel() for p in philox_module.net.parameters())
    assert_standard_normal(philox, "fast_noise='philox'")
    assert_standard_normal(default, "fast_noise=False")
    assert_uncorrelated(philox, default, "philox against the default generator")


def test_philox_run_resumes_bit_identically_and_refuses_another_generator(tmp_path):
    path = tmp_path / "step5.ckpt"
    whole, whole_dp = run("philox", epochs=3, savers=[SaveAt(5, path)])
    resumed, resumed_dp = run("philox", epochs=3, ckpt_path=str(path))
    assert len(resumed.records) == len(whole.records) - 5
    for a, b in zip(whole.net.parameters(), resumed.net.parameters()):
        assert torch.equal(a, b)
    assert resumed_dp.privacy_engine.accountant.history == whole_dp.privacy_engine.accountant.history
    with pytest.raises(ValueError, match="saved with fast_noise='philox'"):
        run("off", epochs=3, ckpt_path=str(path))


@pytest.mark.parametrize("value", ["fast", 1, None])
def test_an_unknown_fast_noise_is_refused_at_construction(value):
    with pytest.raises(ValueError, match="DPCallback: fast_noise must be 'off'.*got"):
        DPCallback(target_delta=1e-5, max_grad_norm=1.0, noise_multiplier=1.0, fast_noise=value)
