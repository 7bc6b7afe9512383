"""What a training loop sees on the parameters, per Opacus generation (opacus_dp.state_views).

Opacus 1.x (``make_private``) and 0.x (``PrivacyEngine(model, ...).attach``): after
``loss.backward()`` ``p.grad`` holds autograd's ordinary gradient in the hooks/functorch modes
and ``p.grad_sample`` the per-sample gradients; ``p.summed_grad`` holds the clipped sum after
``step()`` (1.x) or ``virtual_step()`` (0.x); 1.x keeps both until ``zero_grad()``, 0.x deletes
them at the step. The oracle is plain autograd on a copy of the model and clipping by hand.
"""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.state_views import is_consumed

BATCH, BOUND = 6, 0.05
MATERIALISED = ["hooks", "functorch"]


def build():
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def model_and_data(seed=0):
    torch.manual_seed(seed)
    return build(), torch.randn(4 * BATCH, 5), torch.randint(0, 3, (4 * BATCH,))


def same_weights(model):
    """A plain copy of ``model``'s weights (no hooks) for the oracle."""
    reference = build()
    reference.load_state_dict(model.state_dict())
    return reference


def modern(model, x, y, mode="hooks", logical_batch=BATCH, **options):
    loader = DataLoader(TensorDataset(x, y), batch_size=logical_batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=loader,
            noise_multiplier=0.0, max_grad_norm=BOUND, poisson_sampling=False, grad_sample_mode=mode,
            **options)
    criterion = result[2] if mode == "ghost" else nn.CrossEntropyLoss()
    return result[0], result[1], criterion


def classic(model, mode="hooks"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(model, batch_size=2 * BATCH, sample_size=4 * BATCH, noise_multiplier=0.0,
                               max_grad_norm=BOUND, grad_sample_mode=mode)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        engine.attach(optimizer)
    return engine, optimizer


def plain_grads(model, x, y):
    reference = same_weights(model)
    F.cross_entropy(reference(x), y).backward()
    return [p.grad for p in reference.parameters()]


def clipped_sum(model, x, y):
    """``Σ_i min(1, C/(‖g_i‖+1e-6)) g_i`` per parameter, by autograd one sample at a time."""
    reference = same_weights(model)
    rows = [torch.autograd.grad(F.cross_entropy(reference(x[i:i + 1]), y[i:i + 1]),
                                list(reference.parameters())) for i in range(len(x))]
    sums = [torch.zeros_like(p) for p in reference.parameters()]
    for grads in rows:
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, BOUND / (float(norm) + 1e-6))
        for s, g in zip(sums, grads):
            s.add_(factor * g)
    return sums


@pytest.mark.parametrize("mode", MATERIALISED)
def test_modern_api_lifecycle(mode):
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y, mode)
    params = list(model.parameters())
    assert all(p.grad_sample is None and p.summed_grad is None for p in params)  # from wrapping
    xb, yb = x[:BATCH], y[:BATCH]
    criterion(module(xb), yb).backward()
    for p, g in zip(params, plain_grads(model, xb, yb)):
        torch.testing.assert_close(p.grad, g)  # the ordinary gradient, as autograd leaves it
        assert p.grad_sample.shape == (BATCH, *p.shape)
        torch.testing.assert_close(p.grad_sample.mean(0), g)
    kept, oracle = [p.grad_sample for p in params], clipped_sum(model, xb, yb)
    optimizer.step()
    for p, sample, expected in zip(params, kept, oracle):
        assert p.grad_sample is sample and is_consumed(sample)  # 1.x: kept until zero_grad
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(p.grad, expected / BATCH, rtol=1e-5, atol=1e-7)  # σ = 0
    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        optimizer.step()  # the consumed gradients are never taken twice
    optimizer.zero_grad(set_to_none=False)  # Opacus 1.x's default: p.grad zeroed
    assert all(p.grad_sample is None and p.summed_grad is None and not p.grad.any() for p in params)
    optimizer.zero_grad()  # torch.optim's default since 2.0
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("mode", MATERIALISED)
def test_modern_api_skipped_step_keeps_the_running_sum(mode):
    """1.x: a skipped step (signal_skip_step) shows the running clipped sum, kept by zero_grad;
    the next step's sum covers both pieces."""
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y, mode, logical_batch=2 * BATCH)
    params = list(model.parameters())
    oracle = [a + b for a, b in zip(clipped_sum(model, x[:BATCH], y[:BATCH]),
                                    clipped_sum(model, x[BATCH:2 * BATCH], y[BATCH:2 * BATCH]))]
    optimizer.signal_skip_step(True)
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    assert optimizer.step() is None and all(p.summed_grad is not None for p in params)
    optimizer.zero_grad()
    assert all(p.summed_grad is not None and p.grad_sample is None for p in params)
    criterion(module(x[BATCH:2 * BATCH]), y[BATCH:2 * BATCH]).backward()
    optimizer.step()
    for p, expected in zip(params, oracle):
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", MATERIALISED)
def test_a_backward_pass_after_a_step_without_zero_grad_replaces_the_consumed_samples(mode):
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y, mode)
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    optimizer.step()
    oracle = clipped_sum(model, x[BATCH:2 * BATCH], y[BATCH:2 * BATCH])
    criterion(module(x[BATCH:2 * BATCH]), y[BATCH:2 * BATCH]).backward()
    assert all(p.grad_sample.shape[0] == BATCH for p in model.parameters())
    optimizer.step()
    for p, expected in zip(model.parameters(), oracle):
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", [*MATERIALISED, "bk", "ghost"])
def test_the_step_never_uses_the_ordinary_gradient(mode):
    """Whatever p.grad holds before the step (here: scaled by 1000), the update is the private one."""
    updates = []
    for tamper in (False, True):
        model, x, y = model_and_data()
        module, optimizer, criterion = modern(model, x, y, mode)
        before = [p.detach().clone() for p in model.parameters()]
        criterion(module(x[:BATCH]), y[:BATCH]).backward()
        if tamper:
            for p in model.parameters():
                p.grad = torch.full_like(p, 1000.0)
        optimizer.step()
        updates.append([b - p.detach() for b, p in zip(before, model.parameters())])
    for clean, tampered in zip(*updates):
        torch.testing.assert_close(clean, tampered)


@pytest.mark.parametrize("mode", ["bk", "ghost"])
def test_norms_only_modes_leave_p_grad_to_the_step(mode):
    """bk/ghost (no Opacus 0.x counterpart): autograd's weight gradients are skipped for speed,
    p.grad stays None until the step; skip_weight_grads=False gives the ordinary gradient."""
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y, mode)
    oracle = clipped_sum(model, x[:BATCH], y[:BATCH])
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    assert all(p.grad is None and p.grad_sample is None for p in model.parameters())
    optimizer.step()
    for p, expected in zip(model.parameters(), oracle):
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-5, atol=1e-7)
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y, mode, skip_weight_grads=False)
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    for p, g in zip(model.parameters(), plain_grads(model, x[:BATCH], y[:BATCH])):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("mode", MATERIALISED)
def test_skip_weight_grads_is_an_opt_in_with_the_same_update(mode):
    updates = []
    for skip in (False, True):
        model, x, y = model_and_data()
        module, optimizer, criterion = modern(model, x, y, mode, skip_weight_grads=skip)
        before = [p.detach().clone() for p in model.parameters()]
        criterion(module(x[:BATCH]), y[:BATCH]).backward()
        assert all((p.grad is None) == skip for p in model.parameters())
        optimizer.step()
        updates.append([b - p.detach() for b, p in zip(before, model.parameters())])
    for a, b in zip(*updates):
        torch.testing.assert_close(a, b)


def test_skip_weight_grads_must_be_a_bool():
    model, x, y = model_and_data()
    with pytest.raises(TypeError, match="skip_weight_grads must be a bool"):
        modern(model, x, y, "hooks", skip_weight_grads="yes")


@pytest.mark.parametrize("mode", MATERIALISED)
def test_classic_api_lifecycle(mode):
    """0.x: no attributes before backward; virtual_step() shows summed_grad and deletes
    grad_sample; step() deletes both; p.grad is the ordinary gradient after backward."""
    model, x, y = model_and_data()
    engine, optimizer = classic(model, mode)
    params = list(model.parameters())
    assert not any(hasattr(p, "grad_sample") or hasattr(p, "summed_grad") for p in params)
    first = clipped_sum(model, x[:BATCH], y[:BATCH])
    oracle = [a + b for a, b in zip(first, clipped_sum(model, x[BATCH:2 * BATCH], y[BATCH:2 * BATCH]))]
    F.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()
    for p, g in zip(params, plain_grads(model, x[:BATCH], y[:BATCH])):
        torch.testing.assert_close(p.grad, g)
        assert p.grad_sample.shape == (BATCH, *p.shape)
    optimizer.virtual_step()
    for p, expected in zip(params, first):
        assert not hasattr(p, "grad_sample")
        torch.testing.assert_close(p.summed_grad, expected, rtol=1e-5, atol=1e-7)
    F.cross_entropy(model(x[BATCH:2 * BATCH]), y[BATCH:2 * BATCH]).backward()
    optimizer.step()
    for p, expected in zip(params, oracle):
        assert not hasattr(p, "grad_sample") and not hasattr(p, "summed_grad")
        torch.testing.assert_close(p.grad, expected / (2 * BATCH), rtol=1e-5, atol=1e-7)
    optimizer.zero_grad()
    assert not any(hasattr(p, "grad_sample") or hasattr(p, "summed_grad") for p in params)
    engine.detach()


def test_dropped_optimizer_removes_summed_grad():
    model, x, y = model_and_data()
    module, optimizer, criterion = modern(model, x, y)
    criterion(module(x[:BATCH]), y[:BATCH]).backward()
    optimizer.step()
    del module, optimizer, criterion
    assert not any(hasattr(p, "summed_grad") or hasattr(p, "grad_sample") for p in model.parameters())
