"""Per-sample products on CPU by oneDNN or ``torch.bmm``: the ghost norms' Gram products
(``maths.cpu_products.per_sample_products``) and ``Linear`` layers' per-sample gradients
(``maths.cpu_products.outer_sums``).

Oracles: float64 products of the same float32 operands; for a bookkeeping pass, the norms of
per-sample gradients formed in float64 by autograd one sample at a time. A spy on the oneDNN
entry point shows which products it formed."""

import copy

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.maths import cpu_products
from tests.ghost.test_cpu_products import _clipped_sums, _restore_backend, needs_onednn, onednn_calls  # noqa: F401

PER_THREAD = cpu_products.MIN_SAMPLE_MULTIPLY_ADDS_PER_THREAD


@pytest.fixture
def threads():
    """Set torch's thread count for a test (restored after it)."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _operands(batch, rows, cols, inner, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, rows + cols, inner, generator=gen)
    return a[:, :rows], a[:, rows:]  # row slices of one tensor, as the Gram blocks are


def _close_to_float64(found, rows, cols):
    exact = torch.bmm(rows.double(), cols.double().transpose(1, 2))
    return found.dtype == rows.dtype and found.shape == exact.shape and \
        float((found.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())


def _sequences(batch, positions, left, right, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, positions, left, generator=gen), torch.randn(batch, positions, right, generator=gen)


@needs_onednn
@pytest.mark.parametrize("product", ["gram blocks", "outer sums"])
def test_onednn_forms_each_samples_product_to_float32_rounding(product, onednn_calls, threads):
    """Three samples of 2^22 multiply-adds each: the Gram products' ``rows[i] @ cols[i]ᵀ`` and the
    per-sample gradients' ``g[i]ᵀ x[i]``."""
    threads(1)
    cpu_products.set_cpu_products("onednn")
    if product == "gram blocks":
        rows, cols = _operands(3, 64, 128, 512)
        found = cpu_products.per_sample_products(rows, cols)
        assert onednn_calls == [((64, 512), (128, 512))] * 3
    else:
        g, x = _sequences(3, 128, 256, 128)
        found = cpu_products.outer_sums(g, x)
        rows, cols = g.transpose(1, 2), x.transpose(1, 2)
        assert len(onednn_calls) == 3
    assert _close_to_float64(found, rows, cols)


@needs_onednn
@pytest.mark.parametrize("case", ["torch backend", "float64", "below the threshold", "two threads",
                                  "strided rows", "recorded by autograd", "empty batch"])
def test_other_per_sample_products_are_torchs_bmm_bit_for_bit(case, onednn_calls, threads):
    threads(2 if case == "two threads" else 1)
    cpu_products.set_cpu_products("torch" if case == "torch backend" else "onednn")
    inner = 256 if case in ("below the threshold", "two threads") else 512
    rows, cols = _operands(0 if case == "empty batch" else 3, 64, 128, inner)  # 2^21 per sample at 256
    if case == "float64":
        rows, cols = rows.double(), cols.double()
    if case == "strided rows":
        rows = torch.randn(3, inner, 64).transpose(1, 2)  # each sample's rows are columns in memory
    if case == "below the threshold":
        rows = rows[:, :63]  # one row fewer than 2^21 multiply-adds
    if case == "recorded by autograd":
        rows.requires_grad_(True)
    found = cpu_products.per_sample_products(rows, cols)
    assert onednn_calls == []
    assert torch.equal(found, torch.bmm(rows, cols.transpose(1, 2)))
    assert found.requires_grad == (case == "recorded by autograd")


@needs_onednn
def test_the_threshold_is_per_thread(onednn_calls, threads):
    """One thread takes a product of 2^21 multiply-adds by oneDNN, two threads need twice that."""
    cpu_products.set_cpu_products("onednn")
    rows, cols = _operands(2, 64, 128, 256)
    assert 64 * 128 * 256 == PER_THREAD
    for count, routed in ((1, True), (2, False)):
        threads(count)
        assert cpu_products.routes_samples_to_onednn(rows, cols) is routed
    threads(2)
    assert cpu_products.routes_samples_to_onednn(*_operands(2, 64, 128, 512))


def _exact_norms(model, x):
    """``‖∇_θ Σ_t out_i‖`` per parameter and sample, in float64, one sample at a time."""
    model64 = copy.deepcopy(model).double()
    norms = [[] for _ in model64.parameters()]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model64(x[i:i + 1].double()).sum(), list(model64.parameters()))
        for found, g in zip(norms, grads):
            found.append(g.norm())
    return [torch.stack(n) for n in norms]


@needs_onednn
def test_a_bookkeeping_pass_forms_its_ghost_norms_with_onednn(onednn_calls, threads):
    """A 1024 × 1024 layer at T = 128 takes the ghost norm (``T(d + p) < dp``); its Gram products in
    two row blocks of 64 have 2^23 and 2^22 multiply-adds per sample."""
    threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024))
    x, factors = torch.randn(2, 128, 1024), torch.rand(2)
    norms_torch, _ = _clipped_sums("torch", model, x, factors)
    assert onednn_calls == []
    norms_onednn, _ = _clipped_sums("onednn", model, x, factors)
    grams = [shapes for shapes in onednn_calls if shapes[0] == (64, 1024)]
    assert grams.count(((64, 1024), (128, 1024))) == 2 * 2  # first block: two samples, inputs and gradients
    assert grams.count(((64, 1024), (64, 1024))) == 2 * 2  # second block
    for n_torch, n_onednn, exact in zip(norms_torch, norms_onednn, _exact_norms(model, x)):
        assert torch.allclose(n_onednn.double(), exact, rtol=1e-5, atol=0)
        assert torch.allclose(n_torch.double(), exact, rtol=1e-5, atol=0)


# ------------------------------------------------------------------ per-sample gradients of Linear layers
@needs_onednn
@pytest.mark.parametrize("case", ["torch backend", "float64", "below the threshold", "two threads",
                                  "recorded by autograd", "empty batch"])
def test_other_outer_sums_are_torchs_bmm_bit_for_bit(case, onednn_calls, threads):
    threads(2 if case == "two threads" else 1)
    cpu_products.set_cpu_products("torch" if case == "torch backend" else "onednn")
    g, x = _sequences(0 if case == "empty batch" else 3, 128, 256, 127 if case == "below the threshold" else 128)
    if case == "float64":
        g, x = g.double(), x.double()
    if case == "recorded by autograd":
        g.requires_grad_(True)
    found = cpu_products.outer_sums(g, x)
    assert onednn_calls == []
    assert torch.equal(found, torch.bmm(g.transpose(1, 2), x))
    assert found.requires_grad == (case == "recorded by autograd")


def _exact_per_sample_grads(model, x):
    """``∇_θ Σ_t out_i`` per sample, in float64, one sample at a time."""
    model64 = copy.deepcopy(model).double()
    per_sample = [torch.autograd.grad(model64(x[i:i + 1].double()).sum(), list(model64.parameters()))
                  for i in range(x.shape[0])]
    return [torch.stack(g) for g in zip(*per_sample)]


@needs_onednn
@pytest.mark.parametrize("kind", ["linear", "hf_conv1d"])
def test_hooks_forms_per_sample_gradients_with_onednn(kind, onednn_calls, threads):
    """``hooks`` materialises a 256 → 128 layer's per-sample gradients at T = 128 (2^22 multiply-adds
    per sample) by oneDNN, to float32 rounding of the float64 per-sample gradients."""
    from tests.ghost.test_cpu_products import _layer

    threads(1)
    cpu_products.set_cpu_products("onednn")
    torch.manual_seed(0)
    model = nn.Sequential(_layer(kind, 256, 128))
    x = torch.randn(2, 128, 256)
    wrapper = GradSampleModule(model, loss_reduction="sum")
    out = wrapper(x)
    out.backward(torch.ones_like(out))
    assert len(onednn_calls) == 2  # one per sample, the weight's
    for p, exact in zip(model.parameters(), _exact_per_sample_grads(model, x)):
        found = p.grad_sample.double()
        assert found.shape == exact.shape
        assert float((found - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    wrapper.close()
