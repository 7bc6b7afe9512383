"""Arguments and settings that used to pass silently: each is now refused with its name, or
warned about, before any step.

* ``optimizer.expected_batch_size`` set after ``make_private`` to 0 (the ``mean`` reduction
  would divide by it and write ±inf into the weights);
* δ not below ``1/N`` in ``make_private_with_epsilon`` and the classic engine's σ calibration
  (publishing one random record in the clear is then (0, δ)-DP);
* σ given as a NumPy scalar: accepted by the optimizer as by the accountants, and the noise
  std is σ·C (checked on the update of a model whose gradients are all zero).
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import SamplingWarning
from opacus_dp.engine.classic import PrivacyEngine as ClassicPrivacyEngine
from tests.engine.helpers import sample_std, small_loader, small_model, std_tolerance


def private(noise_multiplier=1.0, n=24):
    model = small_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    with pytest.warns(SamplingWarning, match="fixed-size batches"):
        return engine, *engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=small_loader(n=n),
            noise_multiplier=noise_multiplier, max_grad_norm=1.0, poisson_sampling=False)


@pytest.mark.parametrize("bad", [0, -2, float("nan"), "8"])
def test_expected_batch_size_set_after_make_private_is_checked(bad):
    _, _, optimizer, _ = private()
    with pytest.raises((ValueError, TypeError), match="expected_batch_size"):
        optimizer.expected_batch_size = bad


@pytest.mark.parametrize("delta, warns", [(0.05, True), (1 / 24, True), (1e-5, False)])
def test_delta_not_below_one_over_n_warns_in_make_private_with_epsilon(delta, warns):
    model = small_model()
    engine = PrivacyEngine(accountant="rdp", secure_mode=True)  # no step is taken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), data_loader=small_loader(n=24),
            target_epsilon=2.0, target_delta=delta, epochs=1, max_grad_norm=1.0)
    flagged = [w for w in caught if "1/N = 1/24" in str(w.message)]
    assert bool(flagged) == warns


def test_delta_not_below_one_over_n_warns_in_the_classic_calibration():
    with pytest.warns(UserWarning, match="target_delta=0.1 is not below 1/N = 1/100"):
        ClassicPrivacyEngine(nn.Linear(4, 2), batch_size=10, sample_size=100, target_epsilon=1.0,
                             epochs=1, target_delta=0.1, max_grad_norm=1.0, secure_rng=True)  # no step is taken


def test_numpy_noise_multiplier_is_accepted_and_noises_by_its_value():
    """σ = np.float32(0.5) on zero inputs of a bias-free model (every gradient 0): the update is
    pure noise of std σ·C / E|B| per coordinate (sample std over the weight's 20 000 entries)."""
    torch.manual_seed(0)
    model = nn.Linear(400, 50, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
    data = TensorDataset(torch.zeros(8, 400), torch.zeros(8, 50))
    with pytest.warns(SamplingWarning, match="fixed-size batches"):
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=np.float32(0.5), max_grad_norm=2.0,
            poisson_sampling=False)
    before = model.weight.detach().clone()
    x, y = next(iter(loader))
    ((module(x) - y) ** 2).sum().backward()
    optimizer.step()
    update = before - model.weight.detach()
    expected = 0.5 * 2.0 / optimizer.expected_batch_size
    assert abs(sample_std(update) / expected - 1) < std_tolerance(update.numel())
    assert engine.accountant.history[0][0] == pytest.approx(0.5)


@pytest.mark.parametrize("bound", [np.float32(0.5), np.float64(0.5)])
def test_numpy_max_grad_norm_is_accepted_and_clips_by_its_value(bound):
    """C = np.float32(0.5), σ = 0, one sample x = (3, 4) with loss w·x: its gradient x (norm 5)
    is scaled by C / (5 + 1e-6) (Abadi et al.), so SGD with lr 1 moves w by exactly that."""
    model = nn.Linear(2, 1, bias=False).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp")
        module, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
            data_loader=DataLoader(TensorDataset(torch.tensor([[3.0, 4.0]], dtype=torch.float64)), batch_size=1),
            noise_multiplier=0.0, max_grad_norm=bound, poisson_sampling=False)
    before = model.weight.detach().clone()
    (x,) = next(iter(loader))
    module(x).sum().backward()
    optimizer.step()
    expected = torch.tensor([[3.0, 4.0]], dtype=torch.float64) * 0.5 / (5.0 + 1e-6)
    torch.testing.assert_close(before - model.weight.detach(), expected, rtol=1e-7, atol=0)
    assert optimizer.max_grad_norm == 0.5 and type(optimizer.max_grad_norm) is float


def test_numpy_per_layer_bounds_are_accepted():
    from opacus_dp.optim.clipping import PerLayerClipper, check_max_grad_norm

    clipper = PerLayerClipper([np.float32(3.0), np.int64(4)])
    assert clipper.max_grad_norms == [3.0, 4.0] and clipper.sensitivity == 5.0
    assert check_max_grad_norm(np.float64(2.5)) == 2.5


@pytest.mark.parametrize("bad", [True, np.bool_(True), torch.tensor(1.0), "1.0"])
def test_non_real_max_grad_norm_is_refused_with_its_name(bad):
    from opacus_dp.optim.clipping import check_max_grad_norm

    with pytest.raises(TypeError, match="max_grad_norm must be a positive real number"):
        check_max_grad_norm(bad)


def test_one_finiteness_check_still_names_the_tensor_with_a_non_finite_norm():
    """All norms are checked at once; an error names the first tensor whose norm is NaN or inf."""
    from opacus_dp.optim.clipping import check_finite_norm_list

    finite = [torch.ones(3), torch.full((3,), 2.0, dtype=torch.float64)]
    assert check_finite_norm_list(finite, lambda i: f"t{i}") == finite
    assert check_finite_norm_list([], lambda i: "none") == []
    for bad in (float("nan"), float("inf")):
        norms = finite + [torch.tensor([1.0, bad]), torch.tensor([bad])]
        with pytest.raises(ValueError, match=r"parameter t2:"):
            check_finite_norm_list(norms, lambda i: f"t{i}")
