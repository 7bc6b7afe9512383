"""Clipped sums and ghost norms in IEEE float32 whatever float32 precision the user allowed
(``optim.float32_products``).

Oracle: per-sample gradients formed in float64 from the same float32 inputs, clipped by hand.
The end-to-end checks need a CPU that runs float32 products in bfloat16 when allowed (AMX);
elsewhere the setting changes nothing and they skip (the mechanism tests run everywhere)."""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import opacus_dp
from opacus_dp.grad_sample.bookkeeping import module as bookkeeping_module
from opacus_dp.grad_sample.bookkeeping import passes as bookkeeping_pass
from opacus_dp.maths import float32_products
from opacus_dp.optim import clipping
from opacus_dp.maths.float32_products import ieee_float32_products
from tests.ghost.test_trusted_norms import _cancelling_sequences, _exact_linear_sq_norms, _private_linear


@pytest.fixture(autouse=True)
def _restore_precision():
    settings = float32_products._precision_settings()
    saved = [s.fp32_precision for s in settings]
    generic = getattr(torch.backends, "fp32_precision", None)
    legacy = None if settings else float32_products._legacy_state()
    matmul = torch.get_float32_matmul_precision()  # a flag of its own, not derived from the settings
    yield
    torch.set_float32_matmul_precision(matmul)  # first: it rewrites the per-backend settings
    for s, value in zip(settings, saved):
        s.fp32_precision = value
    if generic is not None:
        torch.backends.fp32_precision = generic
    if legacy is not None:
        float32_products._set_legacy_state(legacy)


def _bmm_error() -> float:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 64, 256, generator=gen), torch.randn(4, 256, 64, generator=gen)
    exact = torch.bmm(a.double(), b.double())
    return float((torch.bmm(a, b).double() - exact).abs().max() / exact.abs().max())


def _reduced_precision_available() -> bool:
    torch.set_float32_matmul_precision("medium")
    try:
        return _bmm_error() > 1e-4
    finally:
        torch.set_float32_matmul_precision("highest")


needs_reduced_precision = pytest.mark.skipif(
    not _reduced_precision_available(),
    reason="this CPU runs float32 products in full precision whatever the setting")


@pytest.mark.skipif(not float32_products._precision_settings(), reason="torch < 2.9: legacy settings")
def test_every_setting_is_ieee_inside_and_the_users_afterwards():
    torch.set_float32_matmul_precision("medium")
    before = [s.fp32_precision for s in float32_products._precision_settings()]
    assert "bf16" in before
    with pytest.raises(RuntimeError, match="boom"):
        with ieee_float32_products():
            assert all(s.fp32_precision in ("ieee", "none")  # "none": torch's default, IEEE
                       for s in float32_products._precision_settings())
            with ieee_float32_products():  # nested: still IEEE, and the outer restore wins
                pass
            assert [s.fp32_precision for s in float32_products._precision_settings()] == [
                "none" if value == "none" else "ieee" for value in before]
            raise RuntimeError("boom")
    assert [s.fp32_precision for s in float32_products._precision_settings()] == before
    assert torch.get_float32_matmul_precision() == "medium"  # the legacy getter still works


@pytest.mark.skipif(not float32_products._precision_settings(), reason="torch < 2.9: legacy settings")
def test_on_cpu_the_settings_of_cpu_products_are_ieee_inside_and_all_restored():
    """For CPU products only oneDNN's settings matter (a global setting shows in them): they are
    IEEE inside, the CUDA ones (cuDNN's TF32 default) are left as they are, all restored after."""
    torch.set_float32_matmul_precision("medium")
    everything = float32_products._precision_settings()
    on_cpu = float32_products._precision_settings(cpu_only=True)
    assert on_cpu == (torch.backends.mkldnn.matmul, torch.backends.mkldnn.conv)
    before = [s.fp32_precision for s in everything]
    assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    with ieee_float32_products(torch.device("cpu")):
        assert all(s.fp32_precision in ("ieee", "none") for s in on_cpu)
        assert [s.fp32_precision for s in everything if s not in on_cpu] == [
            value for s, value in zip(everything, before) if s not in on_cpu]
        gen = torch.Generator().manual_seed(0)
        a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 64, generator=gen)
        assert torch.equal(a @ b, torch.mm(a, b))  # runs; exactness: the end-to-end tests below
    assert [s.fp32_precision for s in everything] == before
    with ieee_float32_products(torch.device("cuda")):  # another device: every setting
        assert all(s.fp32_precision in ("ieee", "none") for s in everything)
    assert [s.fp32_precision for s in everything] == before


def test_the_legacy_settings_are_switched_and_restored(monkeypatch):
    monkeypatch.setattr(float32_products, "_precision_settings", lambda: ())
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    before = float32_products._legacy_state()
    with ieee_float32_products():
        assert float32_products._legacy_state() == ("highest", False, False)
    assert float32_products._legacy_state() == before


@needs_reduced_precision
def test_products_inside_are_as_exact_as_with_the_default_settings():
    baseline = _bmm_error()
    torch.set_float32_matmul_precision("medium")
    assert _bmm_error() > 100 * baseline
    with ieee_float32_products():
        assert _bmm_error() == baseline


def _loss_weights(batch, positions, outputs):
    return torch.randn(batch, positions, outputs, generator=torch.Generator().manual_seed(3))


class _WeightedSum(nn.Module):
    """``Σ w ⊙ y``: the output gradient of every position is the fixed ``w``."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def forward(self, output, target=None):
        return (output * self.weights[: len(output)]).sum()


def _clip_by_hand(grads_w, grads_b, bound=None):
    """``Σ_i min(1, C/(n_i + 1e-6)) g_i`` in float64 (``C``: the median norm if not given)."""
    grads_w, grads_b = grads_w.double(), grads_b.double()
    norms = (grads_w.pow(2).sum(dim=(1, 2)) + grads_b.pow(2).sum(dim=1)).sqrt()
    bound = float(norms.median()) if bound is None else bound
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    return [torch.einsum("b,bpd->pd", factors, grads_w), torch.einsum("b,bp->p", factors, grads_b)], bound


def _clipped_sum(mode, a, weights):
    """The mode's clipped sum next to the oracle: for ``ghost`` and ``bk`` the per-sample
    gradients formed in float64 from ``A`` and ``G``; for ``hooks`` its own per-sample gradients
    (computed with the user's precision like the model's gradient, then measured and summed)."""
    torch.manual_seed(0)
    model = nn.Linear(a.shape[-1], weights.shape[-1])
    criterion = _WeightedSum(weights)
    exact_w = torch.einsum("btp,btd->bpd", weights.double(), a.double())
    _, bound = _clip_by_hand(exact_w, weights.double().sum(dim=1))
    extra = {"criterion": criterion} if mode == "ghost" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = opacus_dp.PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            data_loader=DataLoader(TensorDataset(a, weights), batch_size=len(a)), noise_multiplier=0.0,
            max_grad_norm=bound, grad_sample_mode=mode, poisson_sampling=False, loss_reduction="sum",
            **extra)
    wrapped, optimizer = out[0], out[1]
    criterion = out[2] if len(out) == 4 else criterion
    optimizer.zero_grad()
    criterion(wrapped(a)).backward()
    if mode == "hooks":
        expected, _ = _clip_by_hand(model.weight.grad_sample, model.bias.grad_sample, bound)
    else:
        expected, _ = _clip_by_hand(exact_w, weights.double().sum(dim=1), bound)
    optimizer.clip_and_accumulate()
    return [optimizer.logical_batch.sums[p] for p in (model.weight, model.bias)], expected


def _worst_relative_error(mode):
    a = torch.randn(8, 32, 64, generator=torch.Generator().manual_seed(1))
    got, expected = _clipped_sum(mode, a, _loss_weights(8, 32, 96))
    return max(float((g.double() - e).abs().max() / e.abs().max()) for g, e in zip(got, expected))


@needs_reduced_precision
@pytest.mark.parametrize("mode", ["hooks", "ghost", "bk"])
@pytest.mark.parametrize("precision", ["medium", "high"])
def test_clipped_sums_equal_the_float64_oracle_under_reduced_precision(mode, precision):
    torch.set_float32_matmul_precision(precision)
    assert _worst_relative_error(mode) < 1e-5


@needs_reduced_precision
@pytest.mark.parametrize("mode", ["hooks", "bk"])
def test_without_the_switch_the_clipped_sums_are_off(mode, monkeypatch):
    """The check above can fail here: the user's bfloat16 products alone miss the oracle."""
    for module in (bookkeeping_pass, bookkeeping_module, clipping):
        monkeypatch.setattr(module, "ieee_float32_products", contextlib.nullcontext)
    torch.set_float32_matmul_precision("medium")
    assert _worst_relative_error(mode) > 1e-4


@needs_reduced_precision
@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_a_cancelling_samples_contribution_stays_within_the_bound_under_reduced_precision(mode):
    torch.set_float32_matmul_precision("medium")
    """32 positions, 64 -> 96 (the ghost path); N/n ≈ 9…40, around the check's limit of 16.
    Without the switch the worst contribution measured 1.0022 C."""
    worst = 0.0
    for seed, spread in [(seed, spread) for seed in range(3) for spread in (0.5, 0.3, 0.2, 0.1)]:
        a, y = _cancelling_sequences(spread, batch=1, positions=32, seed=seed)
        bound = _exact_linear_sq_norms(a, y).sqrt().item() / 100
        model, optimizer, criterion = _private_linear(mode, "flat", bound, a, y)
        optimizer.zero_grad()
        criterion(model(a), y).backward()
        optimizer.clip_and_accumulate()
        contribution = torch.sqrt(sum(s.double().pow(2).sum() for s in optimizer.logical_batch.sums.values()))
        worst = max(worst, contribution.item() / bound)
    assert 0.5 < worst <= 1.0 + 1e-6
