"""Classic (Opacus 0.x) API: attach/detach, virtual steps, Poisson, get_privacy_spent, state."""

import math

import pytest
import torch
import torch.nn as nn
from opacus.accountants.analysis import rdp as reference_rdp
from torch.optim import SGD
from torch.utils.data import DataLoader, TensorDataset

from opacus_dp import PrivacyEngine
from opacus_dp.data import EmptyBatchCollate
from opacus_dp.utils.uniform_sampler import UniformWithReplacementSampler
from tests.engine.helpers import (
    clipped_sum_oracle,
    per_sample_grads_oracle,
    restore_classic,
    small_data,
    small_model,
    train_plain,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:secure_mode is off"),
    pytest.mark.filterwarnings("ignore::opacus_dp.data.sampling_checks.SamplingWarning"),
]


def reference_epsilon(q, sigma, steps, alphas, delta):
    rdp = reference_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=alphas)
    return reference_rdp.get_privacy_spent(orders=alphas, rdp=rdp, delta=delta)


def classic_loader(n=20, batch_size=5):
    x, y = small_data(n)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def test_readme_0x_positional_snippet_runs_unchanged():
    train_loader = classic_loader()
    batch_size, sample_size, delta = 5, len(train_loader.dataset), 1e-5
    model = small_model()
    criterion = nn.CrossEntropyLoss()
    # --- Opacus 0.9/0.10 README, with the import changed to opacus_dp ---
    optimizer = SGD(model.parameters(), lr=0.05)
    privacy_engine = PrivacyEngine(
        model,
        batch_size,
        sample_size,
        alphas=[10, 100],
        noise_multiplier=1.3,
        max_grad_norm=1.0,
    )
    privacy_engine.attach(optimizer)
    # Now it's business as usual
    for epoch in range(2):
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
    with pytest.warns(UserWarning, match="optimal RDP order"):  # 10 or 100: the edge of the list
        epsilon, best_alpha = privacy_engine.get_privacy_spent(delta)
    # --- end of snippet ---
    assert privacy_engine.steps == 8
    with pytest.warns(UserWarning):  # order 10 or 100 is at the edge of the list
        eps_ref, alpha_ref = reference_epsilon(0.25, 1.3, 8, [10, 100], delta)
    assert epsilon == pytest.approx(eps_ref, rel=1e-9) and best_alpha == alpha_ref


def test_keyword_0_14_form_with_sample_rate():
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.05)
    privacy_engine = PrivacyEngine(model, sample_rate=0.25, alphas=[2, 4, 8, 16, 32],
                                   noise_multiplier=1.3, max_grad_norm=1.0)
    privacy_engine.attach(optimizer)
    for x, y in classic_loader():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    eps, alpha = privacy_engine.get_privacy_spent(1e-5)
    eps_ref, alpha_ref = reference_epsilon(0.25, 1.3, 4, [2, 4, 8, 16, 32], 1e-5)
    assert (eps, alpha) == (pytest.approx(eps_ref, rel=1e-9), alpha_ref)
    expected = torch.tensor(reference_rdp.compute_rdp(q=0.25, noise_multiplier=1.3, steps=1,
                                                      orders=[2, 4, 8, 16, 32]))
    torch.testing.assert_close(privacy_engine.get_renyi_divergence().double(), expected.double())


def test_sigma0_unbounded_clip_equals_plain_and_detach_restores():
    x, y = small_data(20)
    batches = [(x[i:i + 5], y[i:i + 5]) for i in range(0, 20, 5)]
    expected = train_plain(small_model(), batches, lambda ps: SGD(ps, lr=0.1, momentum=0.9))
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=0.0, max_grad_norm=math.inf)
    engine.attach(optimizer)
    assert optimizer.privacy_engine is engine
    for xb, yb in batches[:2]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    engine.detach()
    assert not {"step", "zero_grad", "virtual_step", "privacy_engine"} & set(vars(optimizer))
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())
    for xb, yb in batches[2:]:  # plain training after detach
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        optimizer.step()
    for a, b in zip(model.parameters(), expected):
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)
    assert engine.steps == 2


def test_virtual_step_loop_of_0x_tutorial_equals_big_batch():
    x, y = small_data(12)
    ref_model = small_model()
    ref_opt = SGD(ref_model.parameters(), lr=0.2)
    PrivacyEngine(ref_model, 12, 24, noise_multiplier=0.0, max_grad_norm=0.2).attach(ref_opt)
    nn.functional.cross_entropy(ref_model(x), y).backward()
    ref_opt.step()

    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.2)
    PrivacyEngine(model, 12, 24, noise_multiplier=0.0, max_grad_norm=0.2).attach(optimizer)
    n_accumulation_steps = 3
    for i in range(3):  # the Opacus 0.x CIFAR-10 example loop
        loss = nn.functional.cross_entropy(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4])
        loss.backward()
        if (i + 1) % n_accumulation_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
        else:
            optimizer.virtual_step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-10, atol=1e-12)
    assert optimizer.privacy_engine.steps == 1


def test_attaching_second_engine_raises():
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1)
    PrivacyEngine(model, 5, 20, noise_multiplier=1.0, max_grad_norm=1.0).attach(optimizer)
    with pytest.raises(ValueError, match="already attached"):
        PrivacyEngine(model, 5, 20, noise_multiplier=1.0, max_grad_norm=1.0).attach(optimizer)


def test_poisson_empty_batches_are_real_steps():
    x, y = small_data(8)
    dataset = TensorDataset(x, y)
    sampler = UniformWithReplacementSampler(num_samples=8, sample_rate=0.125,  # yield empties to
                                            generator=torch.Generator().manual_seed(2),  # the collate
                                            skip_empty=False)
    loader = DataLoader(dataset, batch_sampler=sampler,
                        collate_fn=EmptyBatchCollate.from_dataset(dataset, None))
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, sample_rate=0.125, sample_size=8, alphas=[2, 4, 8, 16, 32, 64],
                           noise_multiplier=1.0, max_grad_norm=1.0, poisson=True)
    engine.attach(optimizer)
    sizes = []
    for _ in range(4):
        for xb, yb in loader:
            sizes.append(len(xb))
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # noise
    assert 0 in sizes and engine.steps == len(sizes) == 32
    eps_ref, _ = reference_epsilon(0.125, 1.0, 32, [2, 4, 8, 16, 32, 64], 1e-5)
    assert engine.get_privacy_spent(1e-5)[0] == pytest.approx(eps_ref, rel=1e-9)


def test_state_dict_keeps_full_history():
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1)
    alphas = [2, 4, 8, 16, 32, 64]
    engine = PrivacyEngine(model, 5, 20, alphas=alphas, noise_multiplier=1.0, max_grad_norm=1.0)
    engine.attach(optimizer)
    x, y = small_data(5)
    for sigma in (1.0, 1.0, 2.0):
        engine.noise_multiplier = sigma
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    other = PrivacyEngine(small_model(), 5, 20, alphas=alphas, noise_multiplier=3.0, max_grad_norm=1.0)
    other.load_state_dict(engine.state_dict())
    rdp = (reference_rdp.compute_rdp(q=0.25, noise_multiplier=1.0, steps=2, orders=alphas)
           + reference_rdp.compute_rdp(q=0.25, noise_multiplier=2.0, steps=1, orders=alphas))
    eps_ref, _ = reference_rdp.get_privacy_spent(orders=alphas, rdp=rdp, delta=1e-5)
    assert other.steps == 3
    assert other.get_privacy_spent(1e-5)[0] == pytest.approx(eps_ref, rel=1e-9)


def test_target_epsilon_calibrates_noise():
    alphas = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    engine = PrivacyEngine(small_model(), 5, 100, alphas=alphas, max_grad_norm=1.0,
                           target_epsilon=2.0, target_delta=1e-5, epochs=3)
    eps, _ = reference_epsilon(0.05, engine.noise_multiplier, 60, alphas, 1e-5)
    assert 2.0 * 0.97 <= eps <= 2.0
    by_rate = PrivacyEngine(small_model(), sample_rate=0.05, alphas=alphas, max_grad_norm=1.0,
                            target_epsilon=2.0, target_delta=1e-5, epochs=3)  # N unknown: no δ check
    assert by_rate.noise_multiplier == engine.noise_multiplier


def test_a_target_epsilon_beside_a_noise_multiplier_is_ignored_with_a_warning():
    """Opacus 0.x kept a given σ and ignored target_epsilon; here it says so (the ε spent at that σ
    can be far above the target)."""
    with pytest.warns(UserWarning, match="target_epsilon=2.0 is ignored"):
        engine = PrivacyEngine(small_model(), 5, 100, noise_multiplier=0.3, max_grad_norm=1.0,
                               target_epsilon=2.0, target_delta=1e-5, epochs=3)
    assert engine.noise_multiplier == 0.3


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((30, 20), dict(noise_multiplier=1.0, max_grad_norm=1.0), "batch_size"),
        ((), dict(sample_rate=1.5, noise_multiplier=1.0, max_grad_norm=1.0), "sample_rate"),
        ((), dict(sample_rate=0.0, noise_multiplier=1.0, max_grad_norm=1.0), "sample_rate"),
        ((5, 20), dict(noise_multiplier=-1.0, max_grad_norm=1.0), "noise_multiplier"),
        ((5, 20), dict(noise_multiplier=1.0, max_grad_norm=0.0), "max_grad_norm"),
        ((5, 20), dict(max_grad_norm=1.0), "noise_multiplier"),
        ((5, 20), dict(noise_multiplier=1.0, max_grad_norm=1.0, loss_reduction="avg"), "loss_reduction"),
        ((), dict(sample_rate=0.1, noise_multiplier=1.0, max_grad_norm=1.0, poisson=True), "sample_size"),
    ],
)
def test_classic_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivacyEngine(small_model(), *args, **kwargs)


def test_per_layer_list_of_wrong_length_is_refused_at_attach():
    model = small_model()
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=1.0, max_grad_norm=[1.0, 1.0])
    optimizer = SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="max_grad_norm has 2 entries"):
        engine.attach(optimizer)
    assert "step" not in vars(optimizer)
    assert all(not m._forward_hooks for m in model.modules())


def test_invalid_model_is_refused_at_attach():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="BatchNorm"):
        engine.attach(SGD(model.parameters(), lr=0.1))


@pytest.mark.filterwarnings("error:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_before_or_after_attach(scheduler_first):
    x, y = small_data(5)
    model = small_model()
    optimizer = SGD(model.parameters(), lr=1.0)
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=0.0, max_grad_norm=math.inf)
    if scheduler_first:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        engine.attach(optimizer)
    else:
        engine.attach(optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference = small_model()
    for lr in (1.0, 0.5):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        loss = nn.functional.cross_entropy(reference(x), y)
        grads = torch.autograd.grad(loss, list(reference.parameters()))
        with torch.no_grad():
            for p, g in zip(reference.parameters(), grads):
                p -= lr * g
    assert engine.steps == 2
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-10, atol=1e-12)


def test_opacus_0x_steps_only_state_dict_means_constant_schedule():
    alphas = [2, 4, 8, 16, 32, 64]
    engine = PrivacyEngine(small_model(), 5, 20, alphas=alphas, noise_multiplier=1.2, max_grad_norm=1.0)
    engine.load_state_dict({"steps": 7})
    eps_ref, _ = reference_epsilon(0.25, 1.2, 7, alphas, 1e-5)
    assert engine.steps == 7
    assert engine.get_privacy_spent(1e-5)[0] == pytest.approx(eps_ref, rel=1e-9)


def test_fixed_size_batches_warn_about_sampling_assumption():
    from opacus_dp.data import SamplingWarning

    model = small_model()
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.warns(SamplingWarning, match="Poisson"):
        engine.attach(SGD(model.parameters(), lr=0.1))


def test_optimizer_with_foreign_parameters_is_refused_at_attach():
    engine = PrivacyEngine(small_model(), 5, 20, noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="not a parameter of the module"):
        engine.attach(SGD(small_model(seed=3).parameters(), lr=0.1))


def test_clip_per_layer_with_one_bound_clips_each_tensor():
    model = small_model()
    x, y = small_data(6)
    grads = per_sample_grads_oracle(model, x, y)
    summed = clipped_sum_oracle(grads, [0.1] * 4, per_layer=True)
    expected = [p.detach() - 0.5 * s / 6 for p, s in zip(model.parameters(), summed)]
    optimizer = SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(model, 6, 24, noise_multiplier=0.0, max_grad_norm=0.1, clip_per_layer=True)
    engine.attach(optimizer)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)
    assert engine._dp_optimizer.max_grad_norm == pytest.approx(0.1 * math.sqrt(4))


@pytest.mark.parametrize("fast_noise", [False, True, "philox"])
@pytest.mark.parametrize("load_before_attach", [False, True])
def test_state_dict_restores_the_noise_stream_before_or_after_attach(load_before_attach, fast_noise):
    """A resumed classic run draws the noise the uninterrupted run would have drawn, whether its
    state is loaded before ``attach`` (kept until then) or after, with each noise generator."""
    def engine_and_model(noise_seed):
        model = nn.Linear(5, 2)
        engine = PrivacyEngine(model, batch_size=8, sample_size=80, noise_multiplier=1.0, max_grad_norm=1.0,
                               noise_generator=torch.Generator().manual_seed(noise_seed), fast_noise=fast_noise)
        return engine, model, SGD(model.parameters(), lr=0.1)

    def noise_of_one_step(model, optimizer):  # zero data gradient: p.grad is the noise
        optimizer.zero_grad()
        (0 * model(torch.zeros(8, 5)).sum()).backward()
        optimizer.step()
        return model.weight.grad.clone()

    engine, model, optimizer = engine_and_model(3)
    engine.attach(optimizer)
    noise_of_one_step(model, optimizer)
    state = engine.state_dict()
    expected = noise_of_one_step(model, optimizer)
    resumed, model2, optimizer2 = engine_and_model(99)
    restore_classic(resumed, optimizer2, state, load_before_attach)
    torch.testing.assert_close(noise_of_one_step(model2, optimizer2), expected, rtol=0, atol=0)
    assert resumed.steps == 2
    other = engine_and_model(99)
    other[0].attach(other[2])
    assert not torch.equal(noise_of_one_step(*other[1:]), noise_of_one_step(model2, optimizer2))  # seeds matter


@pytest.mark.parametrize("fast_noise", [True, "philox"])
def test_fast_noise_is_seeded_by_set_seed_and_keyed_by_the_os_in_secure_mode(fast_noise, monkeypatch):
    """``_set_seed`` keys the fast noise (two engines seeded alike draw alike); with
    ``secure_rng=True`` every step takes its key from the operating system, never a seed."""
    def noise_after_set_seed(seed, **options):
        model = nn.Linear(5, 2)
        engine = PrivacyEngine(model, batch_size=8, sample_size=80, noise_multiplier=1.0, max_grad_norm=1.0,
                               fast_noise=fast_noise, **options)
        optimizer = SGD(model.parameters(), lr=0.1)
        engine.attach(optimizer)
        if seed is not None:
            engine._set_seed(seed)
        (0 * model(torch.zeros(8, 5)).sum()).backward()
        optimizer.step()
        return engine, model.weight.grad.clone()

    assert torch.equal(noise_after_set_seed(5)[1], noise_after_set_seed(5)[1])
    assert not torch.equal(noise_after_set_seed(5)[1], noise_after_set_seed(6)[1])
    import secrets
    keys = []
    original = secrets.randbits
    monkeypatch.setattr(secrets, "randbits", lambda bits: keys.append(bits) or original(bits))
    engine, _ = noise_after_set_seed(None, secure_rng=True)
    assert keys and engine._dp_optimizer.noise.secure_mode
    with pytest.raises(ValueError, match="secure_rng"):
        engine._set_seed(5)


def test_opacus_0x_misc_settings():
    """Opacus 0.x scripts pass ``enable_stat=True`` (its examples did) and may pass the
    experimental clipping settings: the first trains unchanged (with a warning), the
    experimental dynamic bounds (taken from the batch without noise) are refused."""
    with pytest.warns(UserWarning, match="enable_stat=True"):
        engine = PrivacyEngine(small_model(), 5, 100, noise_multiplier=1.0, max_grad_norm=1.0, enable_stat=True)
    reference = PrivacyEngine(small_model(), 5, 100, noise_multiplier=1.0, max_grad_norm=1.0)
    assert (engine.noise_multiplier, engine.sample_rate) == (reference.noise_multiplier, reference.sample_rate)
    with pytest.raises(ValueError, match="not differentially private"):
        PrivacyEngine(small_model(), 5, 100, noise_multiplier=1.0, max_grad_norm=1.0, experimental=True,
                      clipping_method="median")
    with pytest.warns(UserWarning, match="clipping_ratio only apply with experimental=True"):
        PrivacyEngine(small_model(), 5, 100, noise_multiplier=1.0, max_grad_norm=1.0, clipping_ratio=0.5)
    for static in (None, 0, "static"):  # 0.x's default method keeps the fixed bound: private
        PrivacyEngine(small_model(), 5, 100, noise_multiplier=1.0, max_grad_norm=1.0, experimental=True,
                      clipping_method=static)


def _noise_of_one_step(model, optimizer):
    """The update of a step whose data gradient is zero (SGD, lr 1): minus the mean noise."""
    before = model.weight.detach().clone()
    optimizer.zero_grad()
    (0 * model(torch.zeros(8, 5)).sum()).backward()
    optimizer.step()
    return before - model.weight.detach()


@pytest.mark.parametrize("fast_noise", [False, True, "philox"])
@pytest.mark.parametrize("seed_when", ["before_attach", "while_attached", "never"])
def test_detach_and_attach_again_continue_the_noise_stream(seed_when, fast_noise):
    """``detach`` then ``attach`` draws what the uninterrupted run draws: the noise of a released
    step is never drawn again (two steps with equal noise would release a noise-free difference)."""
    def noises(detach_between):
        torch.manual_seed(0)
        model = nn.Linear(5, 2)
        optimizer = SGD(model.parameters(), lr=1.0)
        engine = PrivacyEngine(model, batch_size=8, sample_size=80, noise_multiplier=1.0, max_grad_norm=1.0,
                               fast_noise=fast_noise)
        if seed_when == "before_attach":
            engine._set_seed(3)
        engine.attach(optimizer)
        if seed_when == "while_attached":
            engine._set_seed(3)
        drawn = [_noise_of_one_step(model, optimizer) for _ in range(2)]
        if detach_between:
            engine.detach()
            engine.attach(optimizer)
        return drawn + [_noise_of_one_step(model, optimizer) for _ in range(2)]

    interrupted, uninterrupted = noises(True), noises(False)
    for got, expected in zip(interrupted, uninterrupted):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    assert not any(torch.allclose(a, b) for a in interrupted[:2] for b in interrupted[2:])


@pytest.mark.parametrize("per_layer", [False, True])
def test_detach_keeps_the_clipping_bound_a_schedule_set(per_layer):
    """After ``detach``/``attach`` the engine clips with the bound a clipping schedule left, as it
    keeps the scheduled σ: the next step equals the per-sample oracle at that bound."""
    from opacus_dp.schedulers import StepGradClip

    x, y = small_data(6)
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.5)
    engine = PrivacyEngine(model, 6, 24, noise_multiplier=0.0, max_grad_norm=[0.4] * 4 if per_layer else 0.4)
    engine.attach(optimizer)
    StepGradClip(optimizer, step_size=1, gamma=0.25).step()
    scheduled = engine.max_grad_norm
    engine.detach()
    assert engine.max_grad_norm == scheduled
    engine.attach(optimizer)
    grads = per_sample_grads_oracle(small_model(), x, y)  # the same initial weights, no hooks
    summed = clipped_sum_oracle(grads, [0.1] * 4 if per_layer else 0.1, per_layer=per_layer)
    expected = [p.detach() - 0.5 * s / 6 for p, s in zip(model.parameters(), summed)]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


def test_trainable_parameters_outside_the_attached_optimizer_are_refused():
    """Opacus 0.x's step clipped and noised the gradient of every trainable parameter of the model;
    one outside the attached optimizer would keep autograd's gradient here, which a second, plain
    optimizer would apply: refused at attach. Frozen, the rest trains as the per-sample oracle."""
    x, y = small_data(5)
    model = small_model()
    engine = PrivacyEngine(model, 5, 20, noise_multiplier=0.0, max_grad_norm=0.01)
    with pytest.raises(ValueError, match=r"not in the optimizer given to attach: 0\.weight, 0\.bias"):
        engine.attach(SGD(model[2].parameters(), lr=0.1))
    assert engine.optimizer is None
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    model[0].requires_grad_(False)
    optimizer = SGD(model[2].parameters(), lr=0.1)
    engine.attach(optimizer)
    reference = small_model()
    reference[0].requires_grad_(False)
    summed = clipped_sum_oracle(per_sample_grads_oracle(reference, x, y), 0.01, per_layer=False)
    expected = [p.detach() - 0.1 * s / 5 for p, s in zip(reference[2].parameters(), summed)]
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    for p, e in zip(model[2].parameters(), expected):
        torch.testing.assert_close(p.detach(), e, rtol=1e-9, atol=1e-12)


def test_a_new_sample_rate_is_refused_and_a_new_engine_keeps_the_history():
    """Every step records q, so ``engine.sample_rate = q2`` (an Opacus 0.x attribute) would leave
    batches drawn at q2 accounted at q: refused. The way the error names (a new engine at q2 that
    loads the old one's state) gives the ε of the steps taken (dp-accounting)."""
    from tests.accountants.oracles import dp_accounting_rdp_epsilon

    orders = [2, 4, 8, 16, 32]
    x, y = small_data(10)
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, sample_rate=0.1, sample_size=40, poisson=True, alphas=orders,
                           noise_multiplier=1.0, max_grad_norm=1.0)
    engine.attach(optimizer)
    taken = []
    for q in (0.1, 0.5):
        if q != engine.sample_rate:
            with pytest.raises(AttributeError, match="sample_rate is fixed"):
                engine.sample_rate = q
            assert engine.sample_rate == 0.1
            engine.detach()
            new = PrivacyEngine(model, sample_rate=q, sample_size=40, poisson=True, alphas=orders,
                                noise_multiplier=1.0, max_grad_norm=1.0)
            new.load_state_dict(engine.state_dict())
            new.attach(optimizer)
            engine = new
        for _ in range(3):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            taken.append((1.0, q, 1))
    expected = dp_accounting_rdp_epsilon(taken, 1e-5, orders)
    assert engine.get_privacy_spent(1e-5)[0] == pytest.approx(expected, rel=1e-6)


def test_max_epsilon_is_changed_while_detached_and_enforced_by_the_next_attach():
    """``attach`` installs the budget guard, so ``engine.max_epsilon = ε₂`` while attached would be
    ignored (steps past ε₂ taken): refused. Set while detached, the next ``attach`` enforces it: the
    steps taken spend at most ε₂ and one more would exceed it (dp-accounting)."""
    from opacus_dp.errors import PrivacyBudgetExceededError
    from tests.accountants.oracles import dp_accounting_rdp_epsilon

    orders = [2, 4, 8, 16, 32]
    x, y = small_data(5)
    model = small_model()
    optimizer = SGD(model.parameters(), lr=0.1)
    engine = PrivacyEngine(model, 5, 20, alphas=orders, noise_multiplier=1.0, max_grad_norm=1.0,
                           max_epsilon=50.0, target_delta=1e-5)
    engine.attach(optimizer)
    with pytest.raises(AttributeError, match="max_epsilon was read when the private step was built.*detach"):
        engine.max_epsilon = 5.0
    engine.detach()
    engine.max_epsilon = 5.0
    engine.attach(optimizer)
    with pytest.raises(PrivacyBudgetExceededError):
        for _ in range(100):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    steps = engine.steps
    assert steps > 0
    assert dp_accounting_rdp_epsilon([(1.0, 0.25, steps)], 1e-5, orders) <= 5.0
    assert dp_accounting_rdp_epsilon([(1.0, 0.25, steps + 1)], 1e-5, orders) > 5.0
