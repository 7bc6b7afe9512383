"""Adaptive clipping (Andrew et al. 2021): the bound's trajectory and the updates against a
hand-computed oracle (autograd per-sample gradients), against Opacus 1.6's AdaClipDPOptimizer
where the two agree (fixed-size batches, no noise), the noise split against Theorem 1, the
released count's noise by statistics, the accountant's σ, checkpoints and refusals."""

import math
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import BatchMemoryManager
from opacus_dp.optim.adaptive_clipping import AdaptiveClipper, gradient_noise_multiplier
from tests.distributed.oracle import clipped_mean_update, per_sample_grads, sgd_step
from tests.engine.helpers import small_model

OPTIONS = dict(target_unclipped_quantile=0.6, clipbound_learning_rate=0.5, min_clipbound=0.05, max_clipbound=4.0)
C0, LR = 0.8, 0.3


def _data(n=40, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, n, dtype=torch.float64)[:, None]
    return TensorDataset(x, torch.randint(0, 2, (n,), generator=g))


def _engine(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return PrivacyEngine(**kwargs)


def _private(mode="hooks", sigma=0.0, count_std=0.0, poisson=True, batch_size=8, seed=0, **extra):
    model = small_model(seed)
    engine = _engine(accountant="rdp")
    torch.manual_seed(seed + 11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(_data(), batch_size=batch_size), noise_multiplier=sigma,
            max_grad_norm=C0, clipping="adaptive", poisson_sampling=poisson, grad_sample_mode=mode,
            unclipped_num_std=count_std, **{**OPTIONS, **extra})
    return (engine, *out)


def _train(gsm, optimizer, loader, steps, criterion=None):
    """Train ``steps`` steps; return the batches used and the bound after each step."""
    loss_fn = criterion or nn.CrossEntropyLoss()
    batches, bounds = [], []
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(gsm(x), y).backward()
        optimizer.step()
        batches.append((x, y))
        bounds.append(float(optimizer.max_grad_norm))  # Opacus's is a tensor changed in place
        if len(batches) == steps:
            break
    return batches, bounds


def _oracle(batches, expected_batch_size, seed=0):
    """Hand-computed adaptive DP-SGD with σ = σ_u = 0 (module doc of adaptive_clipping)."""
    model, loss_fn, bound, bounds = small_model(seed), nn.CrossEntropyLoss(), C0, []
    for x, y in batches:
        norms = [torch.cat([g.flatten() for g in s]).norm().item() for s in per_sample_grads(model, loss_fn, x, y)]
        if len(x):
            sgd_step(model, clipped_mean_update(model, loss_fn, x, y, bound, expected_batch_size), LR)
        fraction = min(1.0, max(0.0, (sum(n <= bound for n in norms) - len(norms) / 2) / expected_batch_size + 0.5))
        bound *= math.exp(-OPTIONS["clipbound_learning_rate"] * (fraction - OPTIONS["target_unclipped_quantile"]))
        bounds.append(min(OPTIONS["max_clipbound"], max(OPTIONS["min_clipbound"], bound)))
        bound = bounds[-1]
    return [p.detach() for p in model.parameters()], bounds


@pytest.mark.parametrize("mode", ["hooks", "functorch", "ghost", "bk"])
def test_bound_and_updates_follow_the_oracle_with_poisson_batches(mode):
    engine, gsm, optimizer, *rest = _private(mode)
    criterion = rest[0] if mode == "ghost" else None
    batches, bounds = _train(gsm, optimizer, rest[-1], steps=8, criterion=criterion)
    sizes = {len(x) for x, _ in batches}
    assert len(sizes) > 1, "Poisson batches of several sizes: the divisor must be the expected size"
    expected, expected_bounds = _oracle(batches, optimizer.expected_batch_size)
    assert len(set(expected_bounds)) > 4, "the bound must move"
    assert bounds == pytest.approx(expected_bounds, rel=1e-12)
    for got, want in zip(gsm.parameters(), expected):
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)


def test_batch_memory_manager_counts_the_whole_logical_batch():
    engine, gsm, optimizer, loader = _private(batch_size=10)
    batches, bounds, current, pieces = [], [], [], 0
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=3, optimizer=optimizer) as physical:
        for x, y in physical:
            pieces += 1
            optimizer.zero_grad()
            nn.CrossEntropyLoss()(gsm(x), y).backward()
            current.append((x, y))
            recorded = len(engine.accountant)
            optimizer.step()
            if len(engine.accountant) > recorded:  # the logical step
                batches.append((torch.cat([c[0] for c in current]), torch.cat([c[1] for c in current])))
                bounds.append(optimizer.max_grad_norm)
                current = []
            if len(batches) == 3:
                break
    assert pieces > len(batches) + 2
    _, expected_bounds = _oracle(batches, optimizer.expected_batch_size)
    assert bounds == pytest.approx(expected_bounds, rel=1e-12)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")  # Opacus's hooks (the reference)
def test_same_bounds_and_updates_as_opacus_adaclip_on_fixed_batches():
    """Opacus divides by the sampled batch size and counts without centring; with fixed-size
    batches and no noise both coincide with ours (Opacus keeps the bound in float32)."""
    import opacus

    runs = []
    for engine_class in (opacus.PrivacyEngine, PrivacyEngine):
        model = small_model(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine = engine_class(accountant="rdp")
            out = engine.make_private(
                module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.0, max_grad_norm=C0,
                clipping="adaptive", poisson_sampling=False, unclipped_num_std=1e-300, **OPTIONS)
        gsm, optimizer, loader = out
        _, bounds = _train(gsm, optimizer, loader, steps=5)
        runs.append(([float(b) for b in bounds], [p.detach().clone() for p in gsm.parameters()]))
    (theirs, their_params), (ours, our_params) = runs
    assert len(set(ours)) == len(ours)
    assert ours == pytest.approx(theirs, rel=1e-6)
    for a, b in zip(our_params, their_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_gradient_noise_multiplier_is_theorem_one():
    assert gradient_noise_multiplier(1.0, 2.0) == pytest.approx((1 - 1 / 16) ** -0.5, rel=1e-15)
    assert gradient_noise_multiplier(0.0, 0.0) == 0.0
    # the pair (gradient with σ_Δ, count with sensitivity ½ and std σ_u) is one mechanism with z:
    z, count_std = 1.3, 0.9
    combined = (gradient_noise_multiplier(z, count_std) ** -2 + (count_std / 0.5) ** -2) ** -0.5
    assert combined == pytest.approx(z, rel=1e-12)
    with pytest.raises(ValueError, match="unclipped_num_std"):
        gradient_noise_multiplier(2.0, 1.0)


def _noise_run(steps=1500, sigma=1.0, count_std=2.0, width=40):
    """Half the samples have zero gradients (unclipped), half huge ones (clipped): the true
    centred count is 0, so each step's estimated fraction is ½ + noise/m; lr = 0."""
    torch.manual_seed(21)
    model = nn.Linear(width, width, bias=False).double()
    engine = _engine(accountant="rdp")
    x = torch.cat([torch.zeros(10, width), torch.full((10, width), 1e3)]).double()
    loader = DataLoader(TensorDataset(x, x), batch_size=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm, optimizer, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), data_loader=loader,
            noise_multiplier=sigma, max_grad_norm=1.0, clipping="adaptive", poisson_sampling=False,
            unclipped_num_std=count_std, clipbound_learning_rate=1e-3, min_clipbound=0.5, max_clipbound=2.0)
    fractions, grad_noise = [], []
    direction = torch.outer(x[10], x[10]) / torch.outer(x[10], x[10]).norm()  # of g_i = x_i x_iᵀ
    for step in range(steps):
        optimizer.zero_grad()
        (gsm(x) * x).sum().backward()
        bound = optimizer.max_grad_norm  # C_t, the bound this step clips to
        optimizer.step()
        fractions.append(optimizer.clipper.last_unclipped_fraction)
        if step < 60:  # p.grad = (10 C_t direction + noise) / 20
            grad_noise.append((model.weight.grad * 20 - 10 * bound * direction).flatten() / bound)
    return engine, torch.tensor(fractions, dtype=torch.float64), torch.cat(grad_noise)


def test_count_and_gradient_noise_have_the_stated_stds():
    engine, fractions, grad_noise = _noise_run()
    count_noise = (fractions - 0.5) * 20  # U / m + ½ with U = 0 + N(0, σ_u²), m = 20
    assert (count_noise.abs() < 9).all(), "no clamping at 0 or 1 in this setting"
    se = 2.0 / math.sqrt(2 * len(count_noise))
    assert abs(count_noise.std().item() - 2.0) < 4 * se
    assert abs(count_noise.mean().item()) < 4 * 2.0 / math.sqrt(len(count_noise))
    sigma_delta = gradient_noise_multiplier(1.0, 2.0)  # 1.0328: the gradient's share of σ = 1
    se = sigma_delta / math.sqrt(2 * grad_noise.numel())
    assert abs(grad_noise.std().item() - sigma_delta) < 4 * se
    assert abs(grad_noise.std().item() - 1.0) > 8 * se, "the gradient noise must exceed σ·C"
    assert {sigma for sigma, _, _ in engine.accountant.history} == {1.0}


def test_epsilon_is_that_of_the_total_noise_multiplier():
    from opacus.accountants import RDPAccountant

    engine, gsm, optimizer, loader = _private(sigma=1.1, count_std=1.0)
    _train(gsm, optimizer, loader, steps=4)
    reference = RDPAccountant()
    for _ in range(4):
        reference.step(noise_multiplier=1.1, sample_rate=loader.sample_rate)
    assert engine.get_epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-9)


def test_empty_batch_moves_the_bound_by_the_centred_count_alone():
    _, gsm, optimizer, _ = _private()
    empty = torch.zeros(0, 4, dtype=torch.float64)
    optimizer.zero_grad()
    nn.CrossEntropyLoss()(gsm(empty), torch.zeros(0, dtype=torch.long)).backward()
    optimizer.step()
    expected = C0 * math.exp(-OPTIONS["clipbound_learning_rate"] * (0.5 - OPTIONS["target_unclipped_quantile"]))
    assert optimizer.max_grad_norm == pytest.approx(expected, rel=1e-15)


def test_checkpoint_resumes_the_bound(tmp_path):
    def run(steps_before, steps_after, resume):
        engine, gsm, optimizer, loader = _private(sigma=0.7, count_std=1.0, seed=2)
        optimizer.noise.generator = torch.Generator().manual_seed(5)
        loader.generator.manual_seed(9)
        _train(gsm, optimizer, loader, steps_before)
        if resume:
            engine.save_checkpoint(path=tmp_path / "a.pt", module=gsm, optimizer=optimizer)
            engine, gsm, optimizer, loader = _private(sigma=0.7, count_std=1.0, seed=4)
            engine.load_checkpoint(path=tmp_path / "a.pt", module=gsm, optimizer=optimizer)
        _, bounds = _train(gsm, optimizer, loader, steps_after)
        return bounds, [p.detach().clone() for p in gsm.parameters()]

    straight = run(3, 3, resume=False)
    resumed = run(3, 3, resume=True)
    assert resumed[0][-1] == straight[0][-1] != C0
    for a, b in zip(resumed[1], straight[1]):
        assert torch.equal(a, b)


def test_checkpoint_mismatch_warns(tmp_path):
    engine, gsm, optimizer, loader = _private()
    _train(gsm, optimizer, loader, 2)
    engine.save_checkpoint(path=tmp_path / "a.pt", module=gsm, optimizer=optimizer)
    flat_engine = _engine(accountant="rdp")  # the same mechanism: another one is refused
    model = small_model(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat_gsm, flat_opt, _ = flat_engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
            data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.0, max_grad_norm=C0)
    with pytest.warns(UserWarning, match="fixed bound"):
        flat_engine.load_checkpoint(path=tmp_path / "a.pt", module=flat_gsm, optimizer=flat_opt)
    flat_engine.save_checkpoint(path=tmp_path / "b.pt", module=flat_gsm, optimizer=flat_opt)
    with pytest.warns(UserWarning, match="restarts from max_grad_norm"):
        engine.load_checkpoint(path=tmp_path / "b.pt", module=gsm, optimizer=optimizer)


def _make(**kwargs):
    model = small_model(0)
    args = dict(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                data_loader=DataLoader(_data(), batch_size=8), noise_multiplier=0.5, max_grad_norm=C0,
                clipping="adaptive")  # default σ_u = 8 / 20: σ must stay below 0.8
    args.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _engine().make_private(**args)


@pytest.mark.parametrize("kwargs, match", [
    (dict(unclipped_num_std=0.2), r"smaller than 2 \* unclipped_num_std"),
    (dict(target_unclipped_quantile=1.5), "target_unclipped_quantile must be in"),
    (dict(clipbound_learning_rate=-0.1), "clipbound_learning_rate must be in"),
    (dict(min_clipbound=2.0, max_clipbound=1.0), "max_clipbound must be in"),
    (dict(max_clipbound=0.5), r"max_grad_norm \(the initial bound\)=0.8 must be finite and lie in"),
    (dict(max_grad_norm=[1.0, 1.0, 1.0, 1.0]), "max_grad_norm is a list"),
    (dict(clipping="flat", target_unclipped_quantile=0.5), "only apply to clipping='adaptive'"),
    (dict(noise_multiplier=0.0, max_grad_norm=math.inf), "finite"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _make(**kwargs)


def test_default_count_noise_is_the_papers_and_batch_twenty_needs_sigma_below_two():
    _, optimizer, loader = _make()
    assert optimizer.clipper.unclipped_num_std == pytest.approx(optimizer.expected_batch_size / 20)
    with pytest.raises(ValueError, match="unclipped_num_std"):
        _make(noise_multiplier=0.8 + optimizer.expected_batch_size / 10)


def test_the_bound_cannot_be_set_or_scheduled():
    from opacus_dp.optimizers import AdaClipDPOptimizer
    from opacus_dp.schedulers import StepGradClip

    _, optimizer, _ = _make()
    assert isinstance(optimizer, AdaClipDPOptimizer)
    for name, value in (("max_grad_norm", 0.5), ("max_grad_norms", [0.5])):
        with pytest.raises(ValueError, match="cannot be set with clipping='adaptive'"):
            setattr(optimizer, name, value)
    with pytest.raises(ValueError, match="cannot be set with clipping='adaptive'"):
        StepGradClip(optimizer, step_size=1, gamma=0.5)
    assert optimizer.max_grad_norm == C0


def test_compat_class_and_get_optimizer_class():
    from opacus_dp.optimizers import AdaClipDPOptimizer, DPOptimizer, get_optimizer_class

    assert get_optimizer_class("adaptive", False) is AdaClipDPOptimizer
    model = nn.Linear(3, 2)
    direct = AdaClipDPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                target_unclipped_quantile=0.5, clipbound_learning_rate=0.2, max_clipbound=10.0,
                                min_clipbound=0.1, unclipped_num_std=1.0, max_grad_norm=1.0,
                                expected_batch_size=8)
    assert isinstance(direct.clipper, AdaptiveClipper) and isinstance(direct, DPOptimizer)
    assert not isinstance(DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                                      max_grad_norm=1.0, expected_batch_size=8), AdaClipDPOptimizer)
    with pytest.raises(ValueError, match="needs its settings"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                    expected_batch_size=8, clipping="adaptive")


def test_make_private_with_epsilon_calibrates_the_total_sigma():
    from opacus_dp.accountants import get_noise_multiplier

    model = small_model(0)
    loader = DataLoader(_data(), batch_size=8)
    engine = _engine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, optimizer, dp_loader = engine.make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), data_loader=loader,
            target_epsilon=4.0, target_delta=1e-5, epochs=2, max_grad_norm=C0, clipping="adaptive",
            unclipped_num_std=3.0, alphas=[1.5, 2, 4, 8, 16, 32, 64])
    expected = get_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=dp_loader.sample_rate,
                                    steps=2 * len(dp_loader), accountant="rdp",
                                    alphas=[1.5, 2, 4, 8, 16, 32, 64])
    assert optimizer.noise_multiplier == expected
    assert optimizer.clipper.unclipped_num_std == 3.0


def test_no_learning_rate_overflows_the_bound():
    """η·|f − γ| beyond exp's range: the bound goes to the largest finite float (or the smallest
    positive one) instead of raising after the noisy gradient was set."""
    import sys

    up = AdaptiveClipper(1.0, target_unclipped_quantile=1.0, clipbound_learning_rate=1e300, max_clipbound=math.inf,
                         min_clipbound=0.0, unclipped_num_std=0.0)
    assert up.update(-5.0, 10.0) == pytest.approx(sys.float_info.max, rel=1e-12)  # f = 0: grow
    down = AdaptiveClipper(1.0, target_unclipped_quantile=0.0, clipbound_learning_rate=1e300, max_clipbound=math.inf,
                           min_clipbound=0.0, unclipped_num_std=0.0)
    assert down.update(5.0, 10.0) == sys.float_info.min  # f = 1: shrink, stays > 0
    engine, gsm, optimizer, loader = _private(clipbound_learning_rate=2000.0)
    _train(gsm, optimizer, loader, steps=3)
    assert len(engine.accountant) == 3 and math.isfinite(optimizer.max_grad_norm)


@pytest.mark.parametrize("name", ["clipbound_learning_rate", "unclipped_num_std", "min_clipbound"])
def test_infinite_settings_are_refused(name):
    with pytest.raises(ValueError, match=name):
        _make(**{name: math.inf, "max_clipbound": math.inf})
