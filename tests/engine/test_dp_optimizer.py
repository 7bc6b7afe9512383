"""DPOptimizer against independent oracles (autograd on single samples, hand formulas)."""

import math

import pytest
import torch
import torch.nn as nn

from opacus_dp.grad_sample import GradSampleModule
from opacus_dp.optim import DPOptimizer, grad_source_for
from tests.engine.helpers import (
    clipped_sum_oracle,
    per_sample_grads_oracle,
    small_data,
    small_model,
    train_plain,
)

OPTIMIZERS = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def dp_setup(model, make_opt, **kwargs):
    gsm = GradSampleModule(model, loss_reduction=kwargs.pop("loss_reduction", "mean"))
    opt = DPOptimizer(make_opt(model.parameters()), loss_reduction=gsm.loss_reduction,
                      grad_source=grad_source_for(gsm), **kwargs)
    return gsm, opt


def dp_train(gsm, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(x), y, reduction=gsm.loss_reduction).backward()
        opt.step()
    return [p.detach().clone() for p in gsm._module.parameters()]


def batches(n_batches=3, size=5):
    x, y = small_data(n_batches * size)
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sigma0_unbounded_clip_equals_plain_training(name):
    expected = train_plain(small_model(), batches(), OPTIMIZERS[name])
    gsm, opt = dp_setup(small_model(), OPTIMIZERS[name], noise_multiplier=0.0,
                        max_grad_norm=math.inf, expected_batch_size=5)
    got = dp_train(gsm, opt, batches())
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sigma0_unbounded_clip_equals_plain_training_both_reductions(reduction):
    make = OPTIMIZERS["SGD"]
    expected = train_plain(small_model(), batches(), make, reduction=reduction)
    gsm, opt = dp_setup(small_model(), make, noise_multiplier=0.0, max_grad_norm=math.inf,
                        expected_batch_size=5, loss_reduction=reduction)
    for a, b in zip(dp_train(gsm, opt, batches()), expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_sigma0_small_clip_equals_hand_clipped_mean(reduction, per_layer):
    model = small_model()
    x, y = small_data(7)
    grads = per_sample_grads_oracle(model, x, y)
    bounds = [0.05, 0.2, 0.1, 0.3] if per_layer else 0.1
    summed = clipped_sum_oracle(grads, bounds, per_layer)
    divisor = 10 if reduction == "mean" else 1  # expected batch size 10 ≠ actual 7
    lr = 0.5
    expected = [p.detach() - lr * s / divisor for p, s in zip(model.parameters(), summed)]
    gsm, opt = dp_setup(model, lambda ps: torch.optim.SGD(ps, lr=lr), noise_multiplier=0.0,
                        max_grad_norm=bounds, expected_batch_size=10, loss_reduction=reduction)
    assert any(float(g.reshape(7, -1).norm(dim=1).max()) > 0.3 for g in grads)  # clipping is active
    dp_train(gsm, opt, [(x, y)])
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


def test_virtual_steps_equal_one_step_on_concatenated_batch():
    x, y = small_data(9)
    make = lambda ps: torch.optim.Adam(ps, lr=0.05)  # noqa: E731
    gsm, opt = dp_setup(small_model(), make, noise_multiplier=0.0, max_grad_norm=0.1,
                        expected_batch_size=9)
    reference = dp_train(gsm, opt, [(x, y)])
    gsm2, opt2 = dp_setup(small_model(), make, noise_multiplier=0.0, max_grad_norm=0.1,
                          expected_batch_size=9)
    for lo, hi in [(0, 4), (4, 6)]:
        opt2.zero_grad()
        nn.functional.cross_entropy(gsm2(x[lo:hi]), y[lo:hi]).backward()
        opt2.virtual_step()
    opt2.zero_grad()
    nn.functional.cross_entropy(gsm2(x[6:]), y[6:]).backward()
    opt2.step()
    for a, b in zip(gsm2._module.parameters(), reference):
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)


def test_skip_signals_accumulate_like_virtual_steps():
    x, y = small_data(6)
    make = lambda ps: torch.optim.SGD(ps, lr=0.3)  # noqa: E731
    gsm, opt = dp_setup(small_model(), make, noise_multiplier=0.0, max_grad_norm=0.2,
                        expected_batch_size=6)
    reference = dp_train(gsm, opt, [(x, y)])
    gsm2, opt2 = dp_setup(small_model(), make, noise_multiplier=0.0, max_grad_norm=0.2,
                          expected_batch_size=6)
    for lo, hi, skip in [(0, 2, True), (2, 3, True), (3, 6, False)]:
        opt2.signal_skip_step(do_skip=skip)
        opt2.zero_grad()
        nn.functional.cross_entropy(gsm2(x[lo:hi]), y[lo:hi]).backward()
        opt2.step()
    for a, b in zip(gsm2._module.parameters(), reference):
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("per_layer", [False, True])
def test_noise_std_of_zero_gradient_update(secure, per_layer):
    """Zero data gradient: p.grad is pure noise with std σ·sensitivity / B (≥100k coordinates)."""
    sigma, batch = 1.3, 8
    weight = nn.Parameter(torch.zeros(400, 300))
    bias = nn.Parameter(torch.zeros(300))
    bounds = [0.6, 0.8] if per_layer else 0.7
    sensitivity = 1.0 if per_layer else 0.7
    opt = DPOptimizer(torch.optim.SGD([weight, bias], lr=1.0), noise_multiplier=sigma,
                      max_grad_norm=bounds, expected_batch_size=batch, secure_mode=secure,
                      generator=None if secure else torch.Generator().manual_seed(3))
    weight.grad_sample = torch.zeros(batch, 400, 300)
    bias.grad_sample = torch.zeros(batch, 300)
    opt.step()
    noise = torch.cat([weight.grad.reshape(-1), bias.grad])
    assert noise.numel() >= 100_000
    expected = sigma * sensitivity / batch
    assert abs(float(noise.std()) / expected - 1) < 0.02
    assert abs(float(noise.mean())) < 5 * expected / math.sqrt(noise.numel())


def test_seeded_noise_is_reproducible_and_global_rng_untouched():
    def run(seed):
        p = nn.Parameter(torch.zeros(50))
        opt = DPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=4, generator=torch.Generator().manual_seed(seed))
        p.grad_sample = torch.ones(4, 50)
        state = torch.get_rng_state()
        opt.step()
        assert torch.equal(state, torch.get_rng_state())
        return p.detach().clone()

    assert torch.equal(run(5), run(5))
    assert not torch.equal(run(5), run(6))


def test_step_twice_on_same_gradients_raises():
    gsm, opt = dp_setup(small_model(), OPTIMIZERS["SGD"], noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4)
    x, y = small_data(4)
    nn.functional.cross_entropy(gsm(x), y).backward()
    opt.step()
    before = [p.detach().clone() for p in gsm.parameters()]
    with pytest.raises(RuntimeError, match="step"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, gsm.parameters()))


def test_zero_grad_clears_per_sample_state():
    gsm, opt = dp_setup(small_model(), OPTIMIZERS["SGD"], noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4)
    x, y = small_data(4)
    nn.functional.cross_entropy(gsm(x), y).backward()
    assert all(p.grad_sample is not None for p in gsm.parameters())
    assert all(p.grad is not None for p in gsm.parameters())  # autograd's own gradient, as Opacus
    opt.zero_grad(set_to_none=False)  # Opacus 1.x's default: p.grad zeroed, per-sample state None
    assert all(p.grad_sample is None and not p.grad.any() and p.summed_grad is None for p in gsm.parameters())
    nn.functional.cross_entropy(gsm(x), y).backward()
    opt.zero_grad()  # torch.optim's default since 2.0: the gradients' memory is freed
    assert all(p.grad is None and p.grad_sample is None for p in gsm.parameters())
    with pytest.raises(RuntimeError, match="no per-sample gradients"):
        opt.step()


def test_nan_per_sample_gradient_raises_naming_parameter():
    gsm, opt = dp_setup(small_model(), OPTIMIZERS["SGD"], noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4, param_names=None)
    opt.param_names = {p: n for n, p in gsm._module.named_parameters()}
    opt.non_finite_samples = "refuse"  # the debugging switch (the default drops the sample)
    x, y = small_data(4)
    x[2, 0] = float("nan")
    before = [p.detach().clone() for p in gsm.parameters()]
    nn.functional.cross_entropy(gsm(x), y).backward()
    with pytest.raises(ValueError, match=r"non-finite.*0\.weight"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, gsm.parameters()))


def test_empty_batch_step_is_noise_only():
    gsm, opt = dp_setup(small_model(), OPTIMIZERS["SGD"], noise_multiplier=2.0, max_grad_norm=0.5,
                        expected_batch_size=4, generator=torch.Generator().manual_seed(0))
    x, y = small_data(4)
    nn.functional.cross_entropy(gsm(x[:0]), y[:0]).backward()
    opt.step()
    reference = torch.Generator().manual_seed(0)
    for p in gsm.parameters():
        noise = torch.normal(0.0, 1.0, size=p.shape, generator=reference, dtype=p.dtype)
        torch.testing.assert_close(p.grad, noise / 4)


def test_parameters_without_grad_sample_but_with_grad_raise():
    p = nn.Parameter(torch.zeros(3))
    q = nn.Parameter(torch.zeros(2))
    opt = DPOptimizer(torch.optim.SGD([p, q], lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                      expected_batch_size=2)
    p.grad_sample = torch.ones(2, 3)
    q.grad = torch.ones(2)
    with pytest.raises(ValueError, match="no per-sample gradient"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(noise_multiplier=float("nan")), "noise_multiplier"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=-2.0), "max_grad_norm"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm"),
        (dict(max_grad_norm=float("inf"), noise_multiplier=1.0), "max_grad_norm"),
        (dict(max_grad_norm=[1.0, 1.0]), "max_grad_norm"),
        (dict(max_grad_norm=1.0, clipping="per_layer"), "per-layer"),
        (dict(clipping="adaptive"), "clipping"),
        (dict(loss_reduction="avg"), "loss_reduction"),
        (dict(expected_batch_size=0), "expected_batch_size"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    args = dict(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        DPOptimizer(torch.optim.SGD(small_model().parameters(), lr=0.1), **args)


def test_lr_scheduler_drives_wrapped_optimizer():
    gsm, opt = dp_setup(small_model(), lambda ps: torch.optim.SGD(ps, lr=1.0), noise_multiplier=0.0,
                        max_grad_norm=math.inf, expected_batch_size=4)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = small_data(4)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(gsm(x), y).backward()
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == opt.original_optimizer.param_groups[0]["lr"] == 0.25


def zero_gradient_optimizer(sigma, bound, batch=8):
    weight = nn.Parameter(torch.zeros(300, 200))
    opt = DPOptimizer(torch.optim.SGD([weight], lr=1.0), noise_multiplier=sigma, max_grad_norm=bound,
                      expected_batch_size=batch, generator=torch.Generator().manual_seed(5))
    return weight, opt


def test_noise_multiplier_and_bound_changed_between_steps_set_the_next_steps_noise():
    """A noise or clipping schedule sets ``optimizer.noise_multiplier`` / ``max_grad_norm``
    between steps: the next step's noise std is the new σ · C / B (60 000 coordinates)."""
    weight, opt = zero_gradient_optimizer(1.0, 0.5)
    for sigma, bound in [(1.0, 0.5), (3.0, 0.5), (3.0, 2.0)]:
        opt.noise_multiplier, opt.max_grad_norm = sigma, bound
        weight.grad_sample = torch.zeros(8, 300, 200)
        opt.step()
        assert abs(float(weight.grad.std()) / (sigma * bound / 8) - 1) < 0.03
        opt.zero_grad()


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), None, "1.0"])
def test_bad_noise_multiplier_is_refused_when_set_not_at_the_step(value):
    weight, opt = zero_gradient_optimizer(1.0, 0.5)
    with pytest.raises((ValueError, TypeError), match="noise_multiplier"):
        opt.noise_multiplier = value
    assert opt.noise_multiplier == 1.0


def test_infinite_bound_with_noise_is_refused_when_set():
    weight, opt = zero_gradient_optimizer(1.0, 0.5)
    with pytest.raises(ValueError, match="infinite"):
        opt.max_grad_norm = math.inf
    assert opt.max_grad_norm == 0.5
    opt.noise_multiplier = 0.0
    opt.max_grad_norm = math.inf  # no noise: an unbounded clipper is allowed
    with pytest.raises(ValueError, match="infinite"):
        opt.noise_multiplier = 1.0
