"""Automatic clipping (Bu et al. 2022) and PSAC (Xia et al. 2023) against hand computations:
the factors, the bound on every clipped gradient, the sensitivity, a DPOptimizer step with and
without noise, the registry and the refused options."""

import math

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optim import DPOptimizer, grad_source_for
from opacus_dp.optim.automatic_clipping import AutomaticClipper
from opacus_dp.optim.clipper_registry import CLIPPERS, clipping_names, make_clipper
from opacus_dp.optim.clipping import FlatClipper
from opacus_dp.optim.noise import noise_std
from opacus_dp.optim.psac_clipping import PSACClipper
from tests.engine.helpers import per_sample_grads_oracle, small_data, small_model


def hand_factor(rule: str, norm: float, bound: float, constant: float) -> float:
    """The papers' formulas, in Python floats."""
    if rule == "automatic":
        return bound / (norm + constant)
    return bound / (norm + constant / (norm + constant))


RULES = {"automatic": (AutomaticClipper, "gamma"), "psac": (PSACClipper, "r")}


def clipper(rule: str, bound: float, constant: float):
    cls, option = RULES[rule]
    return make_clipper(rule, bound, **{option: constant})


def grad_samples(seed: int = 0, batch: int = 5):
    """Per-sample gradients of nn.Linear(3, 2) (weight and bias), float64, with spread-out norms."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.01, 0.3, 1.0, 4.0, 50.0], dtype=torch.float64)[:batch]
    weight = torch.randn(batch, 2, 3, generator=g, dtype=torch.float64) * scale.view(-1, 1, 1)
    bias = torch.randn(batch, 2, generator=g, dtype=torch.float64) * scale.view(-1, 1)
    return [weight, bias]


def norms_of(grads):
    return [g.reshape(len(g), -1).norm(dim=1) for g in grads]


@pytest.mark.parametrize("rule, constant", [("automatic", 0.01), ("automatic", 0.5), ("psac", 0.1), ("psac", 2.0)])
def test_factors_match_the_formula_by_hand(rule, constant):
    grads, bound = grad_samples(), 1.7
    factors = clipper(rule, bound, constant).clip_factors(norms_of(grads))
    for i in range(len(grads[0])):
        total = math.sqrt(sum(float(x) ** 2 for g in grads for x in g[i].reshape(-1)))
        expected = hand_factor(rule, total, bound, constant)
        for f in factors:  # the same flat factor for every tensor
            assert f[i].item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rule", ["automatic", "psac"])
def test_every_clipped_gradient_stays_below_the_bound(rule, dtype):
    """‖f_i g_i‖ = C·n/(n + d) < C in exact arithmetic; floats may round it up to C(1 + ulp), so
    the check allows a relative 1e-6 (float32) above C, and strictly below C where d is not
    negligible against n."""
    bound = 0.8
    norms = torch.tensor([0.0, 1e-30, 1e-8, 1e-3, 0.5, 1.0, 3.0, 1e4, 1e8, 1e30], dtype=dtype)
    factors = clipper(rule, bound, 0.05).clip_factors([norms])[0]
    clipped = (factors * norms).double()
    assert bool((clipped <= bound * (1 + 1e-6)).all()), clipped
    moderate = norms.double() <= 1e3
    assert bool((clipped[moderate] < bound).all()), clipped


@pytest.mark.parametrize("rule", ["automatic", "psac"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_dropped_sample_gets_factor_zero_and_factors_are_at_least_float32(rule, dtype):
    """Dropped samples arrive with norm +inf (optim/nonfinite.py): C/(∞ + γ) and
    C/(∞ + r/(∞ + r)) = C/∞ must be exactly 0, never NaN."""
    norms = torch.tensor([float("inf"), 1.0, 0.0], dtype=dtype)
    second = torch.tensor([0.0, 0.0, 0.0], dtype=dtype)
    factors = clipper(rule, 1.0, 0.1).clip_factors([norms, second])
    for f in factors:
        assert f.dtype == torch.float32
        assert f[0].item() == 0.0
        assert bool(torch.isfinite(f).all())


@pytest.mark.parametrize("rule", ["automatic", "psac"])
def test_sensitivity_and_noise_std_are_those_of_the_bound(rule):
    made = clipper(rule, 2.5, 0.3)
    assert made.sensitivity == 2.5 and made.bounds == [2.5]
    assert noise_std(1.2, made) == 1.2 * 2.5
    assert made.gradient_noise_multiplier(1.2) == 1.2


def _linear(dtype=torch.float64) -> nn.Linear:
    model = nn.Linear(3, 2).to(dtype)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3) / 7)
        model.bias.copy_(torch.tensor([0.1, -0.2]))
    return model


def _hand_mean(rule, grads, bound, constant, batch):
    """Σ_i f_i g_i / B with f_i from :func:`hand_factor`."""
    totals = [math.sqrt(sum(float(g[i].pow(2).sum()) for g in grads)) for i in range(len(grads[0]))]
    factors = torch.tensor([hand_factor(rule, n, bound, constant) for n in totals], dtype=torch.float64)
    return [(factors.view(-1, *[1] * (g.dim() - 1)) * g).sum(0) / batch for g in grads]


@pytest.mark.parametrize("rule, constant", [("automatic", 0.01), ("psac", 0.1)])
def test_a_noiseless_step_applies_the_hand_computed_mean(rule, constant):
    grads, bound, batch = grad_samples(), 1.3, 5
    model = _linear()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                            max_grad_norm=bound, expected_batch_size=batch,
                            clipping=clipper(rule, bound, constant))
    for p, g in zip(model.parameters(), grads):
        p.grad_sample = g.clone()
        p.grad = g.sum(0)
    optimizer.step()
    expected = _hand_mean(rule, grads, bound, constant, batch)
    for b, p, e in zip(before, model.parameters(), expected):
        torch.testing.assert_close(b - p.detach(), e, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("rule, constant", [("automatic", 0.01), ("psac", 0.1)])
def test_a_named_rule_trains_like_the_autograd_oracle(rule, constant):
    """clipping="automatic"/"psac" by name (default constants), per-sample gradients from hooks:
    one step equals Σ_i f_i g_i / B with g_i from autograd on single samples."""
    model, (x, y) = small_model(0), small_data(6)
    expected = _hand_mean(rule, per_sample_grads_oracle(model, x, y), 0.9, constant, 6)
    before = [p.detach().clone() for p in model.parameters()]
    gsm = GradSampleModule(model)
    optimizer = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                            max_grad_norm=0.9, expected_batch_size=6, clipping=rule,
                            grad_source=grad_source_for(gsm))
    nn.functional.cross_entropy(gsm(x), y).backward()
    optimizer.step()
    for b, p, e in zip(before, model.parameters(), expected):
        torch.testing.assert_close(b - p.detach(), e, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("rule", ["automatic", "psac"])
def test_the_noise_std_is_sigma_c_over_b(rule):
    """p.grad − (hand-computed clipped mean) is the noise: over 60 000 coordinates its std is
    σ·C/B within 3 % (the sample std's relative standard error is 1/sqrt(2n) ≈ 0.3 %)."""
    sigma, bound, batch = 1.4, 0.6, 8
    g = torch.Generator().manual_seed(11)
    grads = [torch.randn(batch, 200, 300, generator=g, dtype=torch.float64)]
    weight = nn.Parameter(torch.zeros(200, 300, dtype=torch.float64))
    optimizer = DPOptimizer(torch.optim.SGD([weight], lr=1.0), noise_multiplier=sigma, max_grad_norm=bound,
                            expected_batch_size=batch, clipping=rule, generator=torch.Generator().manual_seed(5))
    weight.grad_sample = grads[0].clone()
    optimizer.step()
    constant = 0.01 if rule == "automatic" else 0.1
    noise = weight.grad - _hand_mean(rule, grads, bound, constant, batch)[0]
    expected = sigma * bound / batch
    assert abs(float(noise.std()) / expected - 1) < 0.03
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(noise.numel())


def test_the_registry_has_one_entry_per_rule_and_round_trips():
    assert clipping_names() == list(CLIPPERS) == ["flat", "per_layer", "automatic", "psac", "adaptive"]
    assert type(make_clipper("flat", 1.0)) is FlatClipper
    assert make_clipper("per_layer", [1.0, 2.0]).bounds == [1.0, 2.0]
    auto, psac = make_clipper("automatic", 2.0, gamma=0.2), make_clipper("psac", 3.0, r=0.4)
    assert (type(auto), auto.max_grad_norm, auto.gamma) == (AutomaticClipper, 2.0, 0.2)
    assert (type(psac), psac.max_grad_norm, psac.r) == (PSACClipper, 3.0, 0.4)
    assert make_clipper("automatic", 1.0).gamma == 0.01 and make_clipper("psac", 1.0).r == 0.1
    assert make_clipper(auto, 5.0) is auto
    adaptive = make_clipper("adaptive", 1.0, expected_batch_size=40)
    assert adaptive.unclipped_num_std == 2.0 and adaptive.releases_statistic
    with pytest.raises(ValueError, match="needs its settings"):
        make_clipper("adaptive", 1.0)
    with pytest.raises(ValueError, match="clipping must be one of .*'psac'"):
        make_clipper("auto", 1.0)
    with pytest.raises(ValueError, match="pass its settings to its constructor"):
        make_clipper(auto, 1.0, gamma=0.3)


@pytest.mark.parametrize("rule, option", [("automatic", "gamma"), ("psac", "r")])
@pytest.mark.parametrize("bad", [0, 0.0, -0.1, math.inf, math.nan])
def test_a_bad_constant_is_refused_by_name(rule, option, bad):
    with pytest.raises(ValueError, match=f"^{option} must be a finite number > 0"):
        make_clipper(rule, 1.0, **{option: bad})


@pytest.mark.parametrize("rule, option", [("automatic", "gamma"), ("psac", "r")])
def test_a_constant_of_the_wrong_type_or_an_infinite_bound_is_refused(rule, option):
    for bad in (True, "0.1", torch.tensor(0.1)):
        with pytest.raises(TypeError, match=f"^{option} must be a real number"):
            make_clipper(rule, 1.0, **{option: bad})
    with pytest.raises(ValueError, match="max_grad_norm must be finite"):
        make_clipper(rule, math.inf)
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        make_clipper(rule, 0.0)


@pytest.mark.parametrize("rule, option", [("automatic", "gamma"), ("psac", "r")])
def test_capabilities_of_the_normalising_rules(rule, option):
    made = clipper(rule, 1.0, 0.3)
    moved = made.with_bound(2.0)
    assert (type(moved), moved.max_grad_norm, getattr(moved, option)) == (type(made), 2.0, 0.3)
    with pytest.raises(ValueError, match="max_grad_norms cannot be set"):
        made.with_bounds([1.0, 2.0])
    assert not made.per_tensor and not made.releases_statistic
    with pytest.raises(TypeError, match="not a per-tensor clipper"):
        made.factor_of(0, torch.ones(3))
    shared = made.shared_settings()
    assert set(shared) == set(FlatClipper(1.0).shared_settings())
    assert [k for k, v in shared.items() if v is not None] == [f"{rule} clipping {option}"]
    assert shared[f"{rule} clipping {option}"] == 0.3
    assert repr(made) == f"{type(made).__name__}(max_grad_norm=1.0, {option}=0.3)"
