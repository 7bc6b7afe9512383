"""One plan per run: every setting of make_private is a field of PrivatePlan (or an option of its
clipping rule), validated once; calibration returns a plan; the mechanism is planned once; the
classic engine builds the same plan; the new clipping rules reach the optimizer through it."""

import dataclasses
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import get_noise_multiplier
from opacus_dp.engine import assembly
from opacus_dp.engine.plan import CLIPPING_OPTIONS, PrivatePlan
from tests.engine.helpers import per_sample_grads_oracle, small_data, small_model

OBJECTS = {"self", "module", "optimizer", "data_loader"}


def _plan_names():
    return {f.name for f in dataclasses.fields(PrivatePlan)} | {n for names in CLIPPING_OPTIONS.values() for n in names}


def test_every_setting_of_make_private_is_a_field_of_the_plan():
    settings = set(inspect.signature(PrivacyEngine.make_private).parameters) - OBJECTS
    assert settings <= _plan_names(), f"not in the plan: {settings - _plan_names()}"


def test_make_private_with_epsilon_takes_every_setting_of_make_private():
    plain = set(inspect.signature(PrivacyEngine.make_private).parameters) - {"noise_multiplier"}
    calibrated = set(inspect.signature(PrivacyEngine.make_private_with_epsilon).parameters)
    assert plain <= calibrated, f"missing from make_private_with_epsilon: {plain - calibrated}"
    extra = calibrated - plain - {"target_epsilon", "target_delta", "epochs", "epsilon_tolerance", "epsilon_kwargs"}
    assert not extra, extra


def test_the_plan_is_frozen_and_checked_when_built():
    plan = PrivatePlan(noise_multiplier=1.0, max_grad_norm=[1.0, 2.0], clipping="per_layer", step_timeout=3,
                       public_buffers=["a"])
    assert plan.max_grad_norm == (1.0, 2.0) and plan.step_timeout == 3.0 and plan.public_buffers == ("a",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.noise_multiplier = 2.0
    bad = [dict(noise_multiplier=-1.0), dict(clipping="bogus"), dict(grad_sample_mode="bogus"),
           dict(noise_mechanism="independent", bands=3), dict(noise_mechanism="bogus"),
           dict(clipping_options=(("target_unclipped_quantile", 0.5),)), dict(step_timeout=0),
           dict(secure_mode=True, noise_generator=torch.Generator()), dict(poisson_sampling="yes")]
    for change in bad:
        with pytest.raises((ValueError, TypeError)):
            PrivatePlan(**{"noise_multiplier": 1.0, "max_grad_norm": 1.0, **change})
    assert plan.calibrated(0.7) == dataclasses.replace(plan, noise_multiplier=0.7)
    with pytest.raises(ValueError, match="inf"):
        PrivatePlan(noise_multiplier=0.0, max_grad_norm=float("inf")).calibrated(0.7)


def test_of_takes_the_options_of_the_clipping_rule_given_a_value():
    arguments = dict(noise_multiplier=1.0, max_grad_norm=1.0, clipping="adaptive", target_unclipped_quantile=0.3,
                     clipbound_learning_rate=None, module=object(), unknown_local=1)
    plan = PrivatePlan.of(arguments, secure_mode=True)
    assert plan.options == {"target_unclipped_quantile": 0.3} and plan.secure_mode


def _run(batch=4, n=8):
    x, y = small_data(n)
    return small_model(), DataLoader(TensorDataset(x, y), batch_size=batch)


def test_calibration_returns_the_plan_with_the_calibrated_sigma_and_plans_the_mechanism_once(monkeypatch):
    calls = []
    planned = assembly.plan_mechanism
    monkeypatch.setattr(assembly, "plan_mechanism", lambda *a, **k: calls.append(k) or planned(*a, **k))
    model, loader = _run(n=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, _ = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0, noise_mechanism="banded", bands=2)
    assert len(calls) == 1
    model, loader = _run(n=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, plain, _ = PrivacyEngine(accountant="rdp").make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            target_epsilon=3.0, target_delta=1e-5, epochs=2, max_grad_norm=1.0)
    expected = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=1 / len(loader),
                                    steps=2 * len(loader), accountant="rdp", epsilon_tolerance=0.01)
    assert plain.noise_multiplier == expected


def test_the_classic_engine_builds_the_plan_make_private_builds():
    model = small_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        classic = PrivacyEngine(model, batch_size=4, sample_size=16, noise_multiplier=1.3, max_grad_norm=0.5,
                                poisson=True, grad_sample_mode="bk", batch_first=False, loss_reduction="sum")
    modern = PrivatePlan.of(dict(noise_multiplier=1.3, max_grad_norm=0.5, poisson_sampling=True, grad_sample_mode="bk",
                                 batch_first=False, loss_reduction="sum"), secure_mode=False)
    assert classic.plan() == modern


@pytest.mark.parametrize("rule, factor", [
    ("automatic", lambda n, c: c / (n + 0.01)),
    ("psac", lambda n, c: c / (n + 0.1 / (n + 0.1))),
])
def test_make_private_steps_with_a_clipping_rule_of_the_registry(rule, factor):
    """σ = 0, sum reduction: p.grad = Σ_i f_i g_i with the rule's factor, by an autograd loop."""
    model, loader = _run()
    x, y = next(iter(loader))
    grads = per_sample_grads_oracle(model, x, y)
    norms = torch.sqrt(sum(g.reshape(len(g), -1).pow(2).sum(1) for g in grads))
    expected = [(factor(norms, 0.5).view(-1, *[1] * (g.dim() - 1)) * g).sum(0) for g in grads]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private, optimizer, _ = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=0.5, clipping=rule, poisson_sampling=False, loss_reduction="sum")
    nn.functional.cross_entropy(private(x), y, reduction="sum").backward()
    optimizer.step()
    assert optimizer.clipper.sensitivity == 0.5
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=1e-12)


def test_a_clipper_whose_bound_disagrees_with_max_grad_norm_is_refused():
    from opacus_dp.optim import DPOptimizer
    from opacus_dp.optim.psac_clipping import PSACClipper

    model = small_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="disagrees with the bounds"):
        DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=2.0, expected_batch_size=4, clipping=PSACClipper(1.0))
    assert DPOptimizer(sgd, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4,
                       clipping=PSACClipper(1.0)).max_grad_norm == 1.0


def test_a_registered_accountant_is_accepted_by_the_engine():
    from opacus_dp.accountants import RDPAccountant
    from opacus_dp.accountants.registry import _ACCOUNTANTS, register_accountant

    register_accountant("rdp-copy", RDPAccountant)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert isinstance(PrivacyEngine(accountant="rdp-copy").accountant, RDPAccountant)
    finally:
        _ACCOUNTANTS.pop("rdp-copy")
    with pytest.raises(ValueError, match="accountant"):
        PrivacyEngine(accountant="rdp-copy")
