"""Noise and clipping-bound schedules: the values against Opacus's schedulers and the closed
forms, their effect on the noise and on the accountant (against dp-accounting), resumption."""

import math
import warnings

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.optim import DPOptimizer
from opacus_dp.schedulers import (
    ExponentialGradClip,
    ExponentialNoise,
    LambdaGradClip,
    LambdaNoise,
    StepGradClip,
    StepNoise,
    _NoiseScheduler,
)
from tests.accountants.oracles import dp_accounting_rdp_epsilon
from tests.engine.helpers import small_loader, small_model

EPOCHS = 7
SCHEDULES = {  # name: (ours, Opacus's class name, keyword arguments, closed form of epoch e for v0)
    "ExponentialNoise": (ExponentialNoise, dict(gamma=0.8), lambda v, e: v * 0.8 ** e),
    "StepNoise": (StepNoise, dict(step_size=3, gamma=0.5), lambda v, e: v * 0.5 ** (e // 3)),
    "LambdaNoise": (LambdaNoise, dict(noise_lambda=lambda e: 1 + e), lambda v, e: v * (1 + e)),
    "ExponentialGradClip": (ExponentialGradClip, dict(gamma=1.5), lambda v, e: v * 1.5 ** e),
    "StepGradClip": (StepGradClip, dict(step_size=2, gamma=0.25), lambda v, e: v * 0.25 ** (e // 2)),
    "LambdaGradClip": (LambdaGradClip, dict(scheduler_function=lambda e: 2.0 / (1 + e)),
                       lambda v, e: v * 2.0 / (1 + e)),
}


def dp_optimizer(sigma=1.2, bound=0.7, per_layer=False):
    model = small_model()
    trainable = len(list(model.parameters()))
    return DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=sigma,
                       max_grad_norm=[bound] * trainable if per_layer else bound, expected_batch_size=4)


def value(optimizer, name):
    return optimizer.noise_multiplier if name.endswith("Noise") else optimizer.max_grad_norm


def scheduled_values(make_scheduler, optimizer, name):
    scheduler = make_scheduler(optimizer)
    values = [value(optimizer, name)]
    for _ in range(EPOCHS - 1):
        scheduler.step()
        values.append(value(optimizer, name))
    return values


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_values_equal_opacus_schedulers_and_the_closed_form(name):
    import opacus.optimizers
    import opacus.schedulers

    ours, kwargs, closed_form = SCHEDULES[name]
    reference = getattr(opacus.schedulers, name)
    theirs = opacus.optimizers.DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1),
                                           noise_multiplier=1.2, max_grad_norm=0.7, expected_batch_size=4)
    expected = scheduled_values(lambda o: reference(o, **kwargs), theirs, name)
    actual = scheduled_values(lambda o: ours(o, **kwargs), dp_optimizer(), name)
    start = 1.2 if name.endswith("Noise") else 0.7
    assert actual == pytest.approx(expected, rel=1e-12)
    assert actual == pytest.approx([closed_form(start, e) for e in range(EPOCHS)], rel=1e-12)


def test_grad_clip_schedule_scales_every_per_layer_bound_and_the_noise():
    """Per-layer bounds are scaled together; the noise std follows their norm (σ · ‖C‖ / B)."""
    optimizer = dp_optimizer(bound=0.5, per_layer=True)
    scheduler = StepGradClip(optimizer, step_size=1, gamma=3.0)
    scheduler.step()
    assert optimizer.max_grad_norms == pytest.approx([1.5] * 4)
    for p in optimizer.params:
        p.grad_sample = torch.zeros(4, *p.shape, dtype=p.dtype)
    weight = nn.Parameter(torch.zeros(400, 150, dtype=torch.float64))
    optimizer = DPOptimizer(torch.optim.SGD([weight, nn.Parameter(torch.zeros(1))], lr=1.0),
                            noise_multiplier=2.0, max_grad_norm=[0.3, 0.4], expected_batch_size=4,
                            generator=torch.Generator().manual_seed(2))
    ExponentialGradClip(optimizer, gamma=2.0).step()
    for p in optimizer.params:
        p.grad_sample = torch.zeros(4, *p.shape, dtype=p.dtype)
    optimizer.step()
    assert abs(float(weight.grad.std()) / (2.0 * 1.0 / 4) - 1) < 0.03  # ‖(0.6, 0.8)‖ = 1


def train_epochs(epochs, sigma=1.0, scheduler_state=None, checkpoint=None, resume_from=None):
    """``epochs`` epochs of a private run with ``ExponentialNoise(γ = 0.5)`` stepped per epoch;
    returns ``(engine, optimizer, scheduler)``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        model = small_model()
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=small_loader(), noise_multiplier=sigma, max_grad_norm=1.0)
    scheduler = ExponentialNoise(optimizer, gamma=0.5)
    if resume_from is not None:
        engine.load_checkpoint(path=resume_from, module=module, optimizer=optimizer, noise_scheduler=scheduler)
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(module(x), y).backward()
            optimizer.step()
        scheduler.step()
    if checkpoint is not None:
        engine.save_checkpoint(path=checkpoint, module=module, optimizer=optimizer, noise_scheduler=scheduler)
    return engine, optimizer, scheduler


def test_each_epochs_noise_multiplier_is_accounted():
    """The history against the schedule; ε against dp-accounting (integer orders, where its
    series always converges) and Opacus's RDP accountant (the same default orders)."""
    from opacus.accountants import RDPAccountant as ReferenceRDP

    engine, optimizer, _ = train_epochs(3, sigma=4.0)
    q, steps = 6 / 24, 4
    segments = [(4.0, q, steps), (2.0, q, steps), (1.0, q, steps)]
    assert engine.accountant.history == segments
    orders = list(range(2, 64))
    expected = dp_accounting_rdp_epsilon(segments, 1e-5, orders)
    assert engine.accountant.get_epsilon(1e-5, alphas=orders) == pytest.approx(expected, rel=1e-6)
    reference = ReferenceRDP()
    reference.history = list(segments)
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-10)
    assert optimizer.noise_multiplier == 0.5


def test_resumed_schedule_continues_from_the_saved_value(tmp_path):
    """The optimizer's σ is not part of torch's optimizer state: the scheduler's state carries it,
    so a run resumed after 2 epochs continues 0.25, 0.125 (not 1.0 · 0.5 again)."""
    path = tmp_path / "checkpoint.pt"
    train_epochs(2, checkpoint=path)
    engine, optimizer, scheduler = train_epochs(1, resume_from=path)
    uninterrupted, _, _ = train_epochs(3)
    assert [s for s, _, _ in engine.accountant.history] == [1.0, 0.5, 0.25]
    assert engine.get_epsilon(1e-5) == pytest.approx(uninterrupted.get_epsilon(1e-5), rel=1e-12)
    assert scheduler.last_epoch == 3 and optimizer.noise_multiplier == 0.125


def test_lambda_schedule_state_can_be_saved_with_torch_save(tmp_path):
    scheduler = LambdaNoise(dp_optimizer(), noise_lambda=lambda e: 2.0 ** -e)
    scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=False)
    assert state["last_epoch"] == 1 and state["value"] == pytest.approx(0.6)


class HalvedAtEpochTwo(_NoiseScheduler):
    """A user's schedule written against Opacus's base class (``get_noise_multiplier``)."""

    def get_noise_multiplier(self):
        return self.optimizer.noise_multiplier / 2 if self.last_epoch == 2 else self.optimizer.noise_multiplier


def test_a_subclass_with_its_own_rule():
    optimizer = dp_optimizer(sigma=3.0)
    scheduler = HalvedAtEpochTwo(optimizer)
    values = []
    for _ in range(3):
        scheduler.step()
        values.append(optimizer.noise_multiplier)
    assert values == [3.0, 1.5, 1.5]


@pytest.mark.parametrize("make, error, words", [
    (lambda o: ExponentialNoise(torch.optim.SGD(small_model().parameters(), lr=0.1), gamma=0.5),
     ValueError, "noise_multiplier attribute"),
    (lambda o: StepNoise(o, step_size=0, gamma=0.5), ValueError, "step_size"),
    (lambda o: LambdaNoise(o, noise_lambda=0.5), TypeError, "noise_lambda"),
    (lambda o: LambdaNoise(o, noise_lambda=lambda e: -1.0), ValueError, "noise_multiplier"),
    (lambda o: ExponentialGradClip(o, gamma=math.nan), ValueError, "max_grad_norm"),
])
def test_bad_schedules_are_refused_early(make, error, words):
    optimizer = dp_optimizer()
    with pytest.raises(error, match=words):
        make(optimizer)
        for _ in range(2):  # a bad value is refused at the scheduler step that sets it
            make(optimizer).step()


def attached_classic_engine():
    """A classic engine (σ = 1.2, C = 0.8) attached to SGD over a small model."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = small_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        engine = PrivacyEngine(model, batch_size=6, sample_size=24, noise_multiplier=1.2, max_grad_norm=0.8)
        engine.attach(optimizer)
    return model, optimizer, engine


def test_classic_api_schedule_through_the_attached_optimizer():
    """Classic API: the schedule is built on the optimizer given to ``attach``; the engine's σ
    and C report the scheduled values."""
    model, optimizer, engine = attached_classic_engine()
    noise, clip = StepNoise(optimizer, step_size=1, gamma=0.5), ExponentialGradClip(optimizer, gamma=2.0)
    noise.step()
    clip.step()
    assert engine.noise_multiplier == pytest.approx(0.6) and engine.max_grad_norm == pytest.approx(1.6)


@pytest.mark.parametrize("detach_after_epoch", [None, 0, 2])
def test_classic_schedules_go_on_after_detach_and_attach(detach_after_epoch):
    """A schedule built on a classic engine's optimizer keeps scheduling the private step attached
    after ``detach``/``attach``: every epoch's σ (as the accountant records it) and C follow the
    closed forms, as without the detach."""
    noise_form, clip_form = SCHEDULES["ExponentialNoise"][2], SCHEDULES["StepGradClip"][2]
    model, optimizer, engine = attached_classic_engine()
    noise = ExponentialNoise(optimizer, **SCHEDULES["ExponentialNoise"][1])
    clip = StepGradClip(optimizer, **SCHEDULES["StepGradClip"][1])
    bounds = []
    for epoch in range(4):
        for x, y in small_loader(n=12):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        bounds.append(engine.max_grad_norm)
        if epoch == detach_after_epoch:
            engine.detach()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine.attach(optimizer)
        noise.step()
        clip.step()
    sigmas = [s for s, _, n in engine.accountant.history for _ in range(n)]
    assert sigmas == pytest.approx([noise_form(1.2, e) for e in range(4) for _ in range(2)])
    assert bounds == pytest.approx([clip_form(0.8, e) for e in range(4)])
