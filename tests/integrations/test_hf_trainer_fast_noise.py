"""``PrivacyArguments(fast_noise=...)``: the noise generators of ``make_private`` through the
Hugging Face ``Trainer``.

Oracles: the noise of a step, recovered from the parameter update where it dominates the clipped
sum, is ``N(0, 1)`` after division by ``σ·C`` (Kolmogorov-Smirnov), and another stream than the
default generator's; a resumed run equals the uninterrupted one.
"""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from opacus_dp.integrations.transformers import DPTrainer, PrivacyArguments  # noqa: E402
from opacus_dp.optim.philox_noise import PhiloxGaussianNoise  # noqa: E402
from tests.integrations.hf_trainer_support import (L, LR, Recorder, TokenBlocks, tiny_model,  # noqa: E402
                                                   training_args)
from tests.integrations.noise_statistics import assert_standard_normal, assert_uncorrelated  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

SIGMA, BOUND = 1e4, 1.0  # the noise (σC = 10⁴ per coordinate) hides the clipped sum (norm ≤ n·C)


def private_run(out, privacy, resume=None, **overrides):
    recorder = Recorder()
    trainer = DPTrainer(model=tiny_model(), args=training_args(out, **overrides), train_dataset=TokenBlocks(),
                        data_collator=recorder, callbacks=[recorder], privacy_args=privacy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def params_of(model):
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def first_step_noise(out, fast_noise: str, **privacy) -> torch.Tensor:
    """``z`` of one SGD step: ``Δ = −LR·(S + σC·z)/L``, with the clipped sum ``S`` negligible."""
    before = params_of(tiny_model())
    trainer = private_run(out, PrivacyArguments(target_delta=1e-5, noise_multiplier=SIGMA, max_grad_norm=BOUND,
                                                fast_noise=fast_noise, **privacy), max_steps=1)
    assert trainer.state.global_step == 1
    deltas = [(a.double() - b.double()).flatten() for a, b in zip(params_of(trainer.model), before)]
    return torch.cat(deltas) * (-L / (LR * SIGMA * BOUND))


def test_philox_noise_of_a_step_is_gaussian_and_not_the_default_stream(tmp_path):
    philox, default = first_step_noise(tmp_path / "philox", "philox"), first_step_noise(tmp_path / "off", "off")
    assert_standard_normal(philox, "fast_noise='philox'")
    assert_standard_normal(default, "fast_noise='off'")
    assert_uncorrelated(philox, default, "philox against the default generator")


def test_secure_philox_noise_is_keyed_by_the_operating_system(tmp_path):
    first = first_step_noise(tmp_path / "first", "philox", secure_mode=True)
    second = first_step_noise(tmp_path / "second", "philox", secure_mode=True)  # the same seed, if one were used
    assert_standard_normal(first, "secure fast_noise='philox'")
    assert_uncorrelated(first, second, "two secure runs")


def test_philox_run_resumes_bit_identically_and_refuses_another_generator(tmp_path):
    privacy = PrivacyArguments(target_delta=1e-5, noise_multiplier=0.8, max_grad_norm=0.1, fast_noise="philox")
    full = private_run(tmp_path / "full", privacy, max_steps=6, save_strategy="steps", save_steps=3)
    assert isinstance(full._dp_optimizer.noise, PhiloxGaussianNoise)
    checkpoint = str(tmp_path / "full" / "checkpoint-3")
    resumed = private_run(tmp_path / "resumed", privacy, resume=checkpoint, max_steps=6)
    for got, want in zip(params_of(resumed.model), params_of(full.model)):
        assert torch.equal(got, want)
    assert resumed.privacy_engine.accountant.history == full.privacy_engine.accountant.history
    other = PrivacyArguments(target_delta=1e-5, noise_multiplier=0.8, max_grad_norm=0.1)  # fast_noise="off"
    with pytest.raises(ValueError, match="saved with fast_noise='philox'"):
        private_run(tmp_path / "other", other, resume=checkpoint, max_steps=6)


def test_fast_noise_is_parsed_from_the_command_line():
    parser = transformers.HfArgumentParser(PrivacyArguments)
    (privacy,) = parser.parse_args_into_dataclasses(
        ["--target_delta", "1e-5", "--noise_multiplier", "1.0", "--fast_noise", "philox"])
    assert privacy.fast_noise == "philox"
    (default,) = parser.parse_args_into_dataclasses(["--target_delta", "1e-5", "--noise_multiplier", "1.0"])
    assert default.fast_noise == "off"


@pytest.mark.parametrize("value", ["fast", "True", 1, None])
def test_an_unknown_fast_noise_is_refused_at_construction(value):
    with pytest.raises(ValueError, match="PrivacyArguments: fast_noise must be 'off'.*got"):
        PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0, fast_noise=value)
