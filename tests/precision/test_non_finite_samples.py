"""A sample whose per-sample gradient norm is NaN or inf is dropped (opacus_dp.optim.nonfinite):
the step still happens with its noise and its accountant record, and the clipped sum is the one
of the other samples — checked against a per-sample autograd oracle and against the same step
on the batch without that sample — in every mode, flat and per-layer, on the paths that zero
rows (materialised gradients, ghost products, chunked sums, the ghost mode's sums pass)."""

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample.bookkeeping import chunked_sums, passes
from opacus_dp.grad_sample.bookkeeping.passes import ghost_weighted_grad
from opacus_dp.maths import per_sample
from opacus_dp.maths.per_sample import known_drops, weighted_sum
from opacus_dp.optim.nonfinite import check_policy
from tests.precision.helpers import MODES, clipped_sum, mlp, per_sample_grads, private, squared_error

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode")

BAD = 2


def _data(n=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g, dtype=dtype), torch.randn(n, 4, generator=g, dtype=dtype)


def _as_off_cpu(monkeypatch):
    """``drops_rows`` as off the CPU: without a known answer, zero rows (no check)."""
    def as_off_cpu(factors):
        known = per_sample._KNOWN_DROPS.get()
        return True if known is None else known

    for module in (per_sample, passes, chunked_sums):
        monkeypatch.setattr(module, "drops_rows", as_off_cpu)


def _backward(module, criterion, x, y):
    loss = criterion(module(x), y) if criterion is not None else squared_error(module(x), y)
    loss.backward()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_the_other_samples_clipped_sum_is_exact(mode, clipping, bad_value):
    """NaN reaches every gradient of the sample; inf only the first weight's (tanh saturates):
    per-layer clipping then drops that tensor's part alone."""
    x, y = _data()
    x[BAD, 3] = bad_value
    _, module, optimizer, criterion = private(mlp(dtype=torch.float64), x, y, mode=mode,
                                              clipping=clipping, c=0.5)
    _backward(module, criterion, x, y)
    optimizer.step()
    grads = per_sample_grads(mlp(dtype=torch.float64), x, y)
    assert not torch.isfinite(grads[0][BAD]).all()
    want = clipped_sum(grads, clipping, 0.5)
    for p, w in zip(optimizer.params, want):
        assert torch.isfinite(p.grad).all()
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_the_step_is_noised_and_recorded_as_without_the_sample(mode):
    """Same noise seed: the step on the batch with a NaN sample equals the step on the batch
    without it (the expected batch size is the loader's, unchanged); one accountant record."""
    x, y = _data()
    x[BAD, 0] = float("nan")
    keep = [i for i in range(len(x)) if i != BAD]
    grads = []
    for rows in (list(range(len(x))), keep):
        engine, module, optimizer, criterion = private(mlp(dtype=torch.float64), x, y, mode=mode,
                                                       sigma=1.0, seed=7)
        _backward(module, criterion, x[rows], y[rows])
        optimizer.step()
        assert len(engine.accountant) == 1 and optimizer.steps_taken == 1
        grads.append([p.grad.clone() for p in optimizer.params])
    for with_bad, without in zip(*grads):
        assert torch.isfinite(with_bad).all()
        torch.testing.assert_close(with_bad, without, rtol=1e-10, atol=1e-12)
    sums = clipped_sum(per_sample_grads(mlp(dtype=torch.float64), x[keep], y[keep]), "flat", 1.0)
    noise = torch.cat([(g - s).reshape(-1) for g, s in zip(grads[0], sums)])
    assert 0.5 < float(noise.std()) < 1.5  # σ·C = 1 per coordinate (sum reduction)


def test_a_sample_whose_squared_norm_overflows_float32_is_dropped():
    """Finite but huge inputs of a Linear: the sample's float32 gradient is finite, its squared
    norm is not."""
    x, y = _data(dtype=torch.float32)
    x[BAD] = 5e18
    torch.manual_seed(0)
    _, module, optimizer, _ = private(nn.Linear(8, 4), x, y, mode="hooks")
    squared_error(module(x), y).backward()
    optimizer.step()
    torch.manual_seed(0)
    grads = per_sample_grads(nn.Linear(8, 4), x, y)
    assert all(torch.isfinite(g).all() for g in grads)
    assert not torch.isfinite(torch.linalg.vector_norm(grads[0][BAD])), "the test needs an overflow"
    keep = [i for i in range(len(x)) if i != BAD]
    want = clipped_sum([g[keep] for g in grads], "flat", 1.0)
    for p, w in zip(optimizer.params, want):
        torch.testing.assert_close(p.grad.double(), w, rtol=1e-5, atol=1e-6)


def test_refuse_restores_the_error_and_updates_nothing():
    x, y = _data()
    x[BAD, 0] = float("nan")
    engine, module, optimizer, _ = private(mlp(dtype=torch.float64), x, y, mode="bk")
    optimizer.non_finite_samples = "refuse"
    squared_error(module(x), y).backward()
    with pytest.raises(ValueError, match=r"non-finite .* parameter 0\.weight"):
        optimizer.step()
    assert len(engine.accountant) == 0 and optimizer.steps_taken == 0
    with pytest.raises(ValueError, match="non_finite_samples must be one of"):
        check_policy("skip")


@pytest.mark.parametrize("off_cpu", [False, True])
def test_chunked_per_layer_sums_drop_the_sample(monkeypatch, off_cpu):
    """Per-layer ``bk`` on CPU forms a long sequence's Linear sums in chunks during backward
    (``off_cpu``: zeroing rows without the check, as sums formed in backward do off the CPU)."""
    if off_cpu:
        _as_off_cpu(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 64, 8, generator=g, dtype=torch.float64), torch.randn(4, 64, 4, generator=g,
                                                                                  dtype=torch.float64)
    x[1, 5, 2] = float("nan")
    _, module, optimizer, _ = private(model, x, y, mode="bk", clipping="per_layer", c=0.5)
    squared_error(module(x), y).backward()
    assert "chunked" in module.layer_modes().values()
    optimizer.step()
    torch.manual_seed(0)
    oracle = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    want = clipped_sum(per_sample_grads(oracle, x[[0, 2, 3]], y[[0, 2, 3]]), "per_layer", 0.5)
    for p, w in zip(optimizer.params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)


def test_rows_are_zeroed_not_multiplied_by_zero():
    """``0 · NaN = NaN``: a dropped row must not reach the sum; with no dropped row the zeroing
    path (taken without a device sync off CPU) gives the ordinary sum."""
    g = torch.randn(5, 3, 2, dtype=torch.float64)
    f = torch.rand(5, dtype=torch.float64) + 0.1
    plain = weighted_sum(f, g)
    with known_drops(True):
        torch.testing.assert_close(weighted_sum(f, g), plain, rtol=0, atol=0)
    g[1] = float("nan")
    f_drop = f.clone()
    f_drop[1] = 0.0
    keep = [0, 2, 3, 4]
    want = weighted_sum(f[keep], g[keep])
    torch.testing.assert_close(weighted_sum(f_drop, g), want)  # found by the CPU check
    with known_drops(True):
        torch.testing.assert_close(weighted_sum(f_drop, g), want)


@pytest.mark.parametrize("bias", [True, False])
def test_ghost_products_zero_dropped_rows_per_parameter(bias):
    """A Linear's ghost sum with per-parameter factors: the weight drops sample 1 (NaN input),
    the bias keeps it (its output gradient is finite); forcing the zeroing path without any
    dropped sample changes nothing."""
    layer = nn.Linear(3, 2, bias=bias).double()
    a, b = torch.randn(4, 5, 3, dtype=torch.float64), torch.randn(4, 5, 2, dtype=torch.float64)
    f = torch.rand(4, dtype=torch.float64) + 0.1
    factors = {p: f for p in layer.parameters()}
    plain = ghost_weighted_grad(layer, [a], b, factors, drops=False)
    forced = ghost_weighted_grad(layer, [a], b, factors, drops=True)
    for p in layer.parameters():
        torch.testing.assert_close(forced[p], plain[p], rtol=1e-12, atol=1e-12)
    a[1, 2, 0] = float("nan")
    weight_f = f.clone()
    weight_f[1] = 0.0
    factors = {layer.weight: weight_f, **({layer.bias: f} if bias else {})}
    got = ghost_weighted_grad(layer, [a], b, factors)
    keep = [0, 2, 3]
    want_w = torch.einsum("b,bto,bti->oi", f[keep], b[keep], a[keep])
    torch.testing.assert_close(got[layer.weight], want_w)
    if bias:
        torch.testing.assert_close(got[layer.bias], torch.einsum("b,bto->o", f, b))


@pytest.mark.parametrize("mode,clipping", [("bk", "per_layer"), ("ghost", "flat"), ("hooks", "flat")])
@pytest.mark.parametrize("bad", [False, True])
def test_the_sync_free_path_of_other_devices_gives_the_same_sums(monkeypatch, mode, clipping, bad):
    """Off the CPU, sums formed without a known answer (during the backward pass) zero rows
    without checking for dropped samples first: forced here on the CPU."""
    _as_off_cpu(monkeypatch)
    x, y = _data()
    if bad:
        x[BAD, 3] = float("nan")
    _, module, optimizer, criterion = private(mlp(dtype=torch.float64), x, y, mode=mode,
                                              clipping=clipping, c=0.5)
    _backward(module, criterion, x, y)
    optimizer.step()
    want = clipped_sum(per_sample_grads(mlp(dtype=torch.float64), x, y), clipping, 0.5)
    for p, w in zip(optimizer.params, want):
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-12)
