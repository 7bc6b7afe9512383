"""Opacus 1.6's direct fast-gradient-clipping API (GradSampleModuleFastGradientClipping,
DPOptimizerFastGradientClipping, DPLossFastGradientClipping): the same σ = 0 training as
Opacus's classes with the same calls, and refusals where Opacus would mis-noise silently."""

import pytest
import torch
import torch.nn as nn

BOUND = 0.05


def _data():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 6, generator=g) * 3, torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]


def _train(library_paths, reduction="mean"):
    GSM, Optimizer, Loss = library_paths
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    start = [p.detach().clone() for p in model.parameters()]
    model = GSM(model, max_grad_norm=BOUND, use_ghost_clipping=True, loss_reduction=reduction)
    optimizer = Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=BOUND,
                          expected_batch_size=8, loss_reduction=reduction)
    criterion = Loss(model, optimizer, nn.CrossEntropyLoss(reduction=reduction), loss_reduction=reduction)
    for x, y in _data():
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
    return start, [p.detach().clone() for p in model.parameters()]


def _ours():
    from opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus_dp.optimizers import DPOptimizerFastGradientClipping
    from opacus_dp.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    return GradSampleModuleFastGradientClipping, DPOptimizerFastGradientClipping, DPLossFastGradientClipping


def _theirs():
    from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    return GradSampleModuleFastGradientClipping, DPOptimizerFastGradientClipping, DPLossFastGradientClipping


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.filterwarnings("ignore")
def test_same_training_as_opacus_fast_gradient_clipping(reduction):
    start, ours = _train(_ours(), reduction)
    _, theirs = _train(_theirs(), reduction)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(ours, start))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compat_import_paths_and_optimizer_class():
    import opacus_dp
    from opacus_dp.grad_sample import GradSampleModuleFastGradientClipping
    from opacus_dp.optimizers import DPOptimizerFastGradientClipping, get_optimizer_class

    assert opacus_dp.GradSampleModuleFastGradientClipping is GradSampleModuleFastGradientClipping is _ours()[0]
    assert get_optimizer_class("flat", False, "ghost") is DPOptimizerFastGradientClipping


def _parts(module_bound=BOUND, optimizer_bound=BOUND, reduction="mean"):
    GSM, Optimizer, _ = _ours()
    model = GSM(nn.Linear(6, 3), max_grad_norm=module_bound)
    optimizer = Optimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=1.0,
                          max_grad_norm=optimizer_bound, expected_batch_size=8, loss_reduction=reduction)
    return model, optimizer


def test_bounds_that_disagree_are_refused():
    """Opacus clips to the module's bound and noises to the optimizer's: a larger module bound
    would leave the step under-noised."""
    Loss = _ours()[2]
    model, optimizer = _parts(module_bound=1.0, optimizer_bound=0.1)
    with pytest.raises(ValueError, match=r"module.max_grad_norm=1.0 but optimizer.max_grad_norm=0.1"):
        Loss(model, optimizer, nn.CrossEntropyLoss())
    model, optimizer = _parts(reduction="sum")
    with pytest.raises(ValueError, match="loss reductions disagree"):
        Loss(model, optimizer, nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="GradSampleModuleFastGradientClipping"):
        Loss(nn.Linear(6, 3), optimizer, nn.CrossEntropyLoss())


def test_optimizer_without_the_loss_wrapper_refuses_to_step():
    model, optimizer = _parts()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(model(torch.randn(8, 6)), torch.randint(0, 3, (8,))).backward()
    with pytest.raises(ValueError, match="DPLossFastGradientClipping"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    _ours()[2](model, optimizer, nn.CrossEntropyLoss())  # the pass above must not join the next step
    assert model.pending_passes() == 0 and not optimizer.logical_batch.unfinished


def test_rebuilding_the_loss_wrapper_keeps_the_passes_of_the_coming_step():
    """Only the first connection drops what the optimizer saw before (a loss built per
    iteration must not lose the earlier backward passes of an accumulated step)."""
    from tests.distributed.oracle import clipped_sum, per_sample_grads

    GSM, Optimizer, Loss = _ours()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    start = [p.detach().clone() for p in model.parameters()]
    gsm = GSM(model, max_grad_norm=BOUND, loss_reduction="sum")
    optimizer = Optimizer(torch.optim.SGD(gsm.parameters(), lr=1.0), noise_multiplier=0.0, max_grad_norm=BOUND,
                          expected_batch_size=8, loss_reduction="sum")
    batches = [(x.double(), y) for x, y in _data()[:2]]
    for x, y in batches:
        criterion = Loss(gsm, optimizer, nn.CrossEntropyLoss(reduction="sum"), loss_reduction="sum")
        criterion(gsm(x), y).backward()
    optimizer.step()
    oracle = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for p, s in zip(oracle.parameters(), start):
            p.copy_(s)
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    expected = clipped_sum(per_sample_grads(oracle, nn.CrossEntropyLoss(reduction="sum"), xs, ys), BOUND,
                           list(oracle.parameters()))
    for p, s, e in zip(model.parameters(), start, expected):
        torch.testing.assert_close(s - p.detach(), e, rtol=1e-9, atol=1e-12)
