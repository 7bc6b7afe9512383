"""Per-layer clipping in the ``bk`` mode finishes each layer's clipped sum during backward.

With per-layer clipping a parameter's clip factors depend only on its own norms, so the
``bk`` backward pass computes each layer's clipped sum as soon as the layer is resolved and
keeps neither its inputs nor its output gradients nor materialised per-sample gradients
until the step. The update must equal the deferred computation (itself checked against the
autograd oracle in test_private_training.py), and changing the bounds between backward and
step must be refused.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from tests.ghost.test_private_training import model_and_data, quiet_engine

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PER_LAYER = [0.3] * 6


def private_bk(clipping, seed=0):
    model, data = model_and_data(seed)
    bounds = PER_LAYER if clipping == "per_layer" else 0.5
    gsm, optimizer, _ = quiet_engine(accountant="rdp").make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0, max_grad_norm=bounds,
        clipping=clipping, grad_sample_mode="bk", poisson_sampling=False)
    x, y = data.tensors
    return model, gsm, optimizer, x[:8], y[:8]


def test_per_layer_backward_keeps_only_norms_and_sums():
    model, gsm, optimizer, x, y = private_bk("per_layer")
    nn.functional.cross_entropy(gsm(x), y).backward()
    (finished,) = gsm._bookkeeper._resolved
    assert finished.ghost_calls == [] and finished.grads == {}
    assert set(finished.sums) == set(model.parameters())
    assert set(gsm.layer_modes().values()) == {"ghost", "materialised"}


def test_flat_clipping_keeps_the_layer_calls_until_the_step():
    model, gsm, optimizer, x, y = private_bk("flat")
    nn.functional.cross_entropy(gsm(x), y).backward()
    (finished,) = gsm._bookkeeper._resolved
    assert finished.ghost_calls and finished.grads and not finished.sums


def test_immediate_sums_equal_the_deferred_ones():
    results = []
    for immediate in (True, False):
        model, gsm, optimizer, x, y = private_bk("per_layer", seed=2)
        if not immediate:
            gsm.set_factor_function(None)
        for rows in (slice(0, 5), slice(5, 8)):  # two passes merged by a virtual step
            nn.functional.cross_entropy(gsm(x[rows]), y[rows]).backward()
            optimizer.virtual_step() if rows.start == 0 else optimizer.step()
            optimizer.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert any(not torch.equal(a, p) for a, p in zip(results[0], model_and_data(2)[0].parameters()))


def test_changing_the_bounds_between_backward_and_step_is_refused():
    model, gsm, optimizer, x, y = private_bk("per_layer")
    nn.functional.cross_entropy(gsm(x), y).backward()
    optimizer.max_grad_norms = [0.1] * 6
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="clip factors changed"):
        optimizer.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
