"""The optimizer's batching policy is a constructor argument; one step event (σ, min(1, k·q))
is consumed alike by the accountant and the budget guard; one list of the settings ranks share."""

import ast
import dataclasses
import pathlib
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import RDPAccountant
from opacus_dp.accountants.events import StepEvent, recorded_sample_rate, step_event
from opacus_dp.data import SamplingWarning
from opacus_dp.engine.budget_guard import BudgetGuard
from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optim import BatchingPolicy, DPOptimizer, grad_source_for
from tests.engine.helpers import small_data, small_loader, small_model

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "opacus_dp"


def hooks_optimizer(batching=None, sigma=0.5):
    gsm = GradSampleModule(small_model())
    optimizer = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.1), noise_multiplier=sigma,
                            max_grad_norm=1.0, expected_batch_size=3, grad_source=grad_source_for(gsm),
                            batching=batching)
    return gsm, optimizer


def backward(gsm, rows):
    x, y = small_data(12)
    nn.functional.cross_entropy(gsm(x[rows]), y[rows]).backward()


def test_the_policy_is_given_to_the_constructor_and_read_only():
    _, default = hooks_optimizer()
    assert default.batching == BatchingPolicy()
    assert (default.count_iterations, default.max_batch_size, default.poisson_batches) == (True, None, False)
    policy = BatchingPolicy(count_iterations=False, max_batch_size=3, poisson_batches=True)
    _, optimizer = hooks_optimizer(policy)
    assert (optimizer.count_iterations, optimizer.max_batch_size, optimizer.poisson_batches) == (False, 3, True)
    with pytest.raises(AttributeError):
        optimizer.max_batch_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_batch_size = 4
    with pytest.raises(ValueError, match="max_batch_size"):
        BatchingPolicy(max_batch_size=0)


def test_the_policy_limits_the_logical_batch():
    gsm, optimizer = hooks_optimizer(BatchingPolicy(max_batch_size=3))
    backward(gsm, slice(0, 4))
    with pytest.raises(ValueError, match="more than one logical batch"):
        optimizer.step()


@pytest.mark.filterwarnings("ignore:secure_mode is off")
@pytest.mark.parametrize("poisson", [True, False])
def test_make_private_passes_its_policy(poisson):
    model = small_model()
    fixed_size = pytest.warns(SamplingWarning, match="fixed-size batches")
    with nullcontext() if poisson else fixed_size:
        _, optimizer, _ = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=small_loader(),
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson)
    expected = BatchingPolicy(poisson_batches=True) if poisson else BatchingPolicy(max_batch_size=6)
    assert optimizer.batching == expected


def test_the_classic_engine_passes_its_policy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(small_model(), batch_size=4, sample_size=16, noise_multiplier=1.0,
                               max_grad_norm=1.0, poisson=False)
        engine.attach(torch.optim.SGD(engine.module.parameters(), lr=0.1))
    assert engine._dp_optimizer.batching == BatchingPolicy(count_iterations=False, max_batch_size=4)
    engine.detach()


def test_one_rule_for_the_recorded_rate():
    assert recorded_sample_rate(0.1, 3) == pytest.approx(0.3) and recorded_sample_rate(0.4, 3) == 1.0

    class Fake:
        noise_multiplier = 1.5

    assert step_event(Fake(), 0.2) == StepEvent(1.5, 0.2, 1)


@pytest.mark.parametrize("q", [0.2, 0.6])
def test_accountant_and_guard_consume_the_same_event_once_per_step(q):
    gsm, optimizer = hooks_optimizer(sigma=0.7)
    accountant = RDPAccountant()
    guard = BudgetGuard(accountant, max_epsilon=100.0, delta=1e-5, sample_rate=q)  # far above one step's ε
    checked = []
    check = guard.check
    guard.check = lambda sigma, rate: checked.append((sigma, rate)) or check(sigma, rate)
    optimizer.attach_pre_step_hook(guard)
    optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(q))
    backward(gsm, slice(0, 3))
    backward(gsm, slice(3, 6))  # two passes merged into one step: k = 2
    optimizer.step()
    expected = (0.7, min(1.0, 2 * q))
    assert checked == [expected] and accountant.history == [(*expected, 1)]


def test_accountants_do_not_import_the_optimizer():
    for path in sorted((PACKAGE / "accountants").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                forbidden = ("opacus_dp.optim", "opacus_dp.privacy_engine", "opacus_dp.engine")
                assert not (node.module or "").startswith(forbidden), path


def test_one_list_of_the_settings_ranks_share():
    _, optimizer = hooks_optimizer()
    shared = optimizer.settings_ranks_share()
    assert set(optimizer._step_settings()) <= set(shared)
    assert {"noise_multiplier", "max_grad_norm (sensitivity)", "sum of clipping bounds", "expected_batch_size",
            "loss_reduction(mean=1)", "poisson_sampling(yes=1)"} <= set(shared)
    configure = (PACKAGE / "distributed" / "configure.py").read_text()
    assert "settings_ranks_share()" in configure and '"noise_multiplier"' not in configure
