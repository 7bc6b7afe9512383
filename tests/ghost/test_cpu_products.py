"""The clipped sums' matrix products on CPU by torch's BLAS or by oneDNN (``maths.cpu_products``).

Oracles: float64 products of the same float32 operands; for a bookkeeping pass, the factor-weighted
sum of per-sample gradients formed in float64 by autograd one sample at a time. A spy on the
oneDNN entry point shows which products it formed."""

import copy

import pytest
import torch
import torch.nn as nn

import opacus_dp
from opacus_dp.grad_sample import BookkeepingGradSampleModule
from opacus_dp.maths import cpu_products, heap_threshold
from tests.ghost.test_float32_products import _restore_precision, needs_reduced_precision  # noqa: F401

needs_onednn = pytest.mark.skipif(not cpu_products.onednn_available(), reason="torch built without oneDNN")


@pytest.fixture(autouse=True)
def _restore_backend(monkeypatch):
    monkeypatch.delenv(cpu_products.ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(cpu_products, "_backend", None)
    yield


@pytest.fixture
def onednn_calls(monkeypatch):
    calls = []
    real = cpu_products._onednn_linear

    def spy(left, right_t):
        calls.append((tuple(left.shape), tuple(right_t.shape)))
        return real(left, right_t)

    monkeypatch.setattr(cpu_products, "_onednn_linear", spy)
    return calls


def _operands(m, k, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, m, generator=gen).t(), torch.randn(k, n, generator=gen)  # left as a transposed view


def _cpu(monkeypatch, vendor, flags, mkl=True):
    monkeypatch.setattr(cpu_products, "_cpu_flags_and_vendor", lambda: (set(flags), vendor))
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)


def test_torch_is_torch_bit_for_bit(onednn_calls):
    cpu_products.set_cpu_products("torch")
    left, right = _operands(256, 512, 256)
    assert torch.equal(cpu_products.matrix_product(left, right), left.mm(right))
    assert onednn_calls == []


@pytest.mark.parametrize("vendor, flags, mkl", [
    ("GenuineIntel", {"avx2", "avx512f"}, True),  # MKL runs AVX-512 there
    ("AuthenticAMD", {"avx2"}, True),  # no wider code than MKL's to gain
    ("AuthenticAMD", {"avx2", "avx512f"}, False),  # another BLAS: not measured, left alone
    ("", set(), True),  # no /proc/cpuinfo (not Linux)
])
def test_the_default_is_torch_where_mkl_uses_the_widest_instructions(monkeypatch, onednn_calls, vendor, flags, mkl):
    _cpu(monkeypatch, vendor, flags, mkl)
    assert cpu_products.cpu_products() == "torch"
    left, right = _operands(256, 512, 256)
    assert torch.equal(cpu_products.matrix_product(left, right), left.mm(right))
    assert onednn_calls == []


@needs_onednn
def test_the_default_is_onednn_on_an_amd_cpu_with_avx512(monkeypatch, onednn_calls):
    _cpu(monkeypatch, "AuthenticAMD", {"avx2", "avx512f", "avx512bw"})
    assert cpu_products.cpu_products() == "onednn"
    cpu_products.matrix_product(*_operands(256, 512, 256))
    assert len(onednn_calls) == 1
    monkeypatch.setattr(cpu_products, "_backend", None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(cpu_products, "_onednn_works", None)
    assert cpu_products.cpu_products() == "torch"  # auto never refuses: torch where oneDNN is missing


def test_auto_can_be_asked_for_and_resolves_to_a_backend(monkeypatch):
    _cpu(monkeypatch, "GenuineIntel", {"avx512f"})
    with cpu_products.cpu_products_set_to("auto"):
        assert cpu_products.cpu_products() == "torch"
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "auto")
    assert cpu_products.cpu_products() == "torch"


def test_this_machines_cpu_is_read_from_proc_cpuinfo():
    flags, vendor = cpu_products._cpu_flags_and_vendor()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        assert (flags, vendor) == (set(), "")
        return
    first = text.split("\n\n")[0]
    assert f"vendor_id\t: {vendor}" in first or (vendor == "" and "vendor_id" not in first)
    assert all(flag in first.split() for flag in flags)
    assert cpu_products.automatic_backend() == (
        "onednn" if (vendor == "AuthenticAMD" and "avx512f" in flags and torch.backends.mkl.is_available()
                     and cpu_products.onednn_available()) else "torch")


@needs_onednn
def test_onednn_forms_large_products_to_float32_rounding(onednn_calls):
    cpu_products.set_cpu_products("onednn")
    left, right = _operands(256, 512, 256)  # 2^25 multiply-adds
    found = cpu_products.matrix_product(left, right)
    exact = left.double() @ right.double()
    assert found.dtype == torch.float32 and found.shape == (256, 256)
    assert float((found.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    assert onednn_calls == [((256, 512), (256, 512))]


@needs_onednn
@pytest.mark.parametrize("layout, oriented", [
    ("contiguous left", "as given"),  # nothing copied
    ("transposed left, narrow right", "transposed"),  # copies the narrow side and the result, not left
    ("transposed left, wide right", "as given"),  # copying left is the cheaper
])
def test_onednn_takes_the_orientation_that_copies_least(layout, oriented, monkeypatch):
    """oneDNN copies a non-contiguous first operand; a clipped sum's ``Gᵀ`` is a transposed view
    of the batch's output gradients."""
    firsts = []
    real = cpu_products._onednn_linear
    monkeypatch.setattr(cpu_products, "_onednn_linear",
                        lambda first, second: firsts.append(first) or real(first, second))
    cpu_products.set_cpu_products("onednn")
    gen = torch.Generator().manual_seed(3)
    rows, m, n = 2048, 512, (64 if "narrow" in layout else 1024)
    left = torch.randn(m, rows, generator=gen) if layout == "contiguous left" else torch.randn(rows, m, generator=gen).t()
    right = torch.randn(rows, n, generator=gen)
    found = cpu_products.matrix_product(left, right)
    exact = left.double() @ right.double()
    assert found.shape == (m, n) and found.is_contiguous()
    assert float((found.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    assert len(firsts) == 1
    if oriented == "as given":
        assert firsts[0].shape == (m, rows)
    else:
        assert firsts[0].shape == (n, rows)


@needs_onednn
@pytest.mark.parametrize("case", ["small", "few rows", "float64", "meta"])
def test_onednn_leaves_other_products_to_torch(case, onednn_calls, monkeypatch):
    cpu_products.set_cpu_products("onednn")
    monkeypatch.setattr(heap_threshold, "_raised", False)  # as in a process whose heap is not settled
    if case == "small":  # below MIN_MULTIPLY_ADDS: oneDNN's fixed cost per call outweighs its gain
        left, right = _operands(64, 512, 64)
    elif case == "few rows":  # 2^25 multiply-adds over 32 rows: faults of a fresh result dominate
        left, right = _operands(1024, 32, 1024)
        assert 32 < cpu_products.MIN_INNER and 1024 * 32 * 1024 >= cpu_products.MIN_MULTIPLY_ADDS
    else:
        left, right = (t.to(torch.float64 if case == "float64" else "meta") for t in _operands(256, 512, 256))
    found = cpu_products.matrix_product(left, right)
    assert onednn_calls == []
    if case != "meta":
        assert torch.equal(found, left.mm(right))


@needs_onednn
def test_a_setting_for_a_block_is_undone_after_it():
    cpu_products.set_cpu_products("onednn")
    with pytest.raises(KeyError):
        with cpu_products.cpu_products_set_to("torch"):
            assert cpu_products.cpu_products() == "torch"
            raise KeyError("inside")
    assert cpu_products.cpu_products() == "onednn"


def test_the_availability_probe_leaves_the_random_streams_alone(monkeypatch):
    """A probe drawing from torch's global generator shifted a seeded run's data and noise by
    where in the run the first wrapper was built."""
    monkeypatch.setattr(cpu_products, "_onednn_works", None)
    before = torch.get_rng_state()
    cpu_products.onednn_available()
    assert cpu_products._onednn_works is not None
    assert torch.equal(torch.get_rng_state(), before)


def test_bad_backend_names_are_refused(monkeypatch):
    _cpu(monkeypatch, "GenuineIntel", {"avx512f"})
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'torch', 'onednn'\), got 'mkl'"):
        opacus_dp.set_cpu_products("mkl")
    assert cpu_products._backend is None  # nothing set: the default applies


def test_the_environment_variable_is_read_once_and_checked(monkeypatch):
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "fast")
    with pytest.raises(ValueError, match="OPACUS_DP_CPU_PRODUCTS='fast'"):
        cpu_products.cpu_products()
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "torch")
    assert cpu_products.cpu_products() == "torch"
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "fast")  # read once: set_cpu_products from now on
    assert cpu_products.cpu_products() == "torch"


def test_a_bad_environment_variable_is_refused_when_the_model_is_wrapped(monkeypatch):
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "mkl")
    with pytest.raises(ValueError, match="OPACUS_DP_CPU_PRODUCTS='mkl'"):
        BookkeepingGradSampleModule(nn.Linear(4, 2))


def test_onednn_is_refused_where_torch_has_none(monkeypatch):
    monkeypatch.setattr(cpu_products, "_onednn_works", None)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no usable oneDNN.*use 'torch'"):
        cpu_products.set_cpu_products("onednn")
    monkeypatch.setenv(cpu_products.ENVIRONMENT_VARIABLE, "onednn")
    with pytest.raises(RuntimeError, match="unset OPACUS_DP_CPU_PRODUCTS"):
        cpu_products.cpu_products()


def _clipped_sums(backend, model, x, factors):
    cpu_products.set_cpu_products(backend)
    wrapper = BookkeepingGradSampleModule(model, loss_reduction="sum")
    out = wrapper(x)
    out.backward(torch.ones_like(out))
    params = [p for _, p in wrapper.trainable_parameters()]
    norms = wrapper.per_sample_norms(params)
    sums = wrapper.clipped_sums(params, [factors] * len(params))
    wrapper.close()
    return norms, sums


def _oracle(model, x, factors):
    """``Σ_i f_i ∇_θ Σ_t out_i`` in float64, one sample at a time."""
    model64 = copy.deepcopy(model).double()
    total = [torch.zeros_like(p) for p in model64.parameters()]
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model64(x[i:i + 1].double()).sum(), list(model64.parameters()))
        total = [t + float(factors[i]) * g for t, g in zip(total, grads)]
    return total


def _layer(kind, d, p):
    if kind == "linear":
        return nn.Linear(d, p)
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(p, d)  # GPT-2's layer: weight stored (d, p)
    nn.init.normal_(layer.bias)
    return layer


@needs_onednn
@pytest.mark.parametrize("kind", ["linear", "hf_conv1d"])
@pytest.mark.parametrize("features", [(64, 512), (512, 64)])  # either side the smaller (scaled) one
def test_a_bookkeeping_pass_forms_its_clipped_sums_with_onednn(kind, features, onednn_calls):
    torch.manual_seed(0)
    d, p = features
    model = nn.Sequential(_layer(kind, d, p))
    x = torch.randn(32, 32, d)  # 1024 rows: d·p·rows = 2^25 multiply-adds; T(d + p) < dp: not materialised
    factors = torch.rand(32)
    norms_torch, sums_torch = _clipped_sums("torch", model, x, factors)
    assert onednn_calls == []
    norms_onednn, sums_onednn = _clipped_sums("onednn", model, x, factors)
    # the orientation copying the fewest values: the smaller side's (scaled) rows first
    assert [shape for shape, _ in onednn_calls] == [(min(d, p), 1024)]
    for n_torch, n_onednn in zip(norms_torch, norms_onednn):
        assert torch.equal(n_torch, n_onednn)  # the norms are not routed
    for found, reference, exact in zip(sums_onednn, sums_torch, _oracle(model, x, factors)):
        scale = float(exact.abs().max())
        assert float((found.double() - exact).abs().max()) <= 2e-5 * scale
        assert float((reference.double() - exact).abs().max()) <= 2e-5 * scale


@needs_onednn
@needs_reduced_precision
def test_onednn_products_stay_ieee_when_the_user_allows_bfloat16(onednn_calls):
    torch.set_float32_matmul_precision("medium")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 64))
    x, factors = torch.randn(32, 32, 512), torch.rand(32)
    _, sums = _clipped_sums("onednn", model, x, factors)
    assert onednn_calls
    exact = _oracle(model, x, factors)[0]
    assert float((sums[0].double() - exact).abs().max()) <= 2e-5 * float(exact.abs().max())


@needs_onednn
@pytest.mark.parametrize("columns,routed", [(1024, True), (4096, False)])
def test_a_product_of_few_rows_goes_to_onednn_where_the_settled_heap_keeps_its_result(
        columns, routed, onednn_calls, monkeypatch):
    """Over 32 rows: a 4 MiB result stays on glibc's settled heap (no page to fault in again), so
    oneDNN forms it; a 64 MiB one is still mapped afresh, so torch's path (huge pages) does."""
    cpu_products.set_cpu_products("onednn")
    monkeypatch.setattr(heap_threshold, "_raised", True)
    left, right = _operands(columns, 32, columns)
    found = cpu_products.matrix_product(left, right)
    assert (onednn_calls != []) == routed
    exact = left.double() @ right.double()
    assert float((found.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
