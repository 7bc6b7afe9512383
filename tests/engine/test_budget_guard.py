"""Privacy budget guard: stops exactly at the first step whose ε would exceed the budget."""

import pytest
import torch
import torch.nn as nn

from opacus_dp import PrivacyEngine
from opacus_dp.accountants import create_accountant
from opacus_dp.data import SamplingWarning
from opacus_dp.engine.budget_guard import BudgetGuard, steps_added, with_extra_steps
from opacus_dp.errors import PrivacyBudgetExceededError
from tests.engine.helpers import small_loader, small_model

pytestmark = pytest.mark.filterwarnings("ignore:secure_mode is off")


def epsilon_after(mechanism, sigma, q, steps, delta):
    """ε of ``steps`` steps, by stepping a fresh accountant one step at a time."""
    acc = create_accountant(mechanism)
    for _ in range(steps):
        acc.step(noise_multiplier=sigma, sample_rate=q)
    return acc.get_epsilon(delta)


def assert_stops_at(mechanism, sigma, q, max_eps, delta, steps):
    """``steps`` is the right stopping point: ε(steps) ≤ max_eps < ε(steps + 1)."""
    assert epsilon_after(mechanism, sigma, q, steps, delta) <= max_eps
    assert epsilon_after(mechanism, sigma, q, steps + 1, delta) > max_eps


# gdp's notice that it approximates ε is tested in tests/accountants/test_accountant_api.py
GDP_NOTICE_TESTED_ELSEWHERE = pytest.mark.filterwarnings("ignore:GaussianAccountant \\(gdp\\) uses the central limit")


@pytest.mark.parametrize("mechanism", ["rdp", pytest.param("gdp", marks=GDP_NOTICE_TESTED_ELSEWHERE), "prv"])
def test_guard_remaining_steps_match_step_by_step_oracle(mechanism):
    sigma, q, max_eps, delta = 1.5, 0.1, 2.0, 1e-5
    guard = BudgetGuard(create_accountant(mechanism), max_epsilon=max_eps, delta=delta, sample_rate=q)
    remaining = guard.remaining_steps(sigma, q)
    assert remaining >= 10
    assert_stops_at(mechanism, sigma, q, max_eps, delta, remaining)


def test_guard_stops_engine_at_right_step_without_changing_anything():
    sigma, max_eps, delta = 1.0, 8.0, 1e-5
    engine = PrivacyEngine(accountant="rdp", max_epsilon=max_eps, max_epsilon_delta=delta)
    model = small_model()
    gsm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=small_loader(n=12, batch_size=3), noise_multiplier=sigma, max_grad_norm=1.0)
    taken = 0
    with pytest.raises(PrivacyBudgetExceededError, match="max_epsilon"):
        for _ in range(100):
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(gsm(x), y).backward()
                before = [p.detach().clone() for p in model.parameters()]
                noise_state = opt.noise_state_dict()["state"].clone()
                opt.step()
                taken += 1
    assert taken == len(engine.accountant) and taken >= 10
    assert_stops_at("rdp", sigma, 0.25, max_eps, delta, taken)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.equal(noise_state, opt.noise_state_dict()["state"])  # no noise drawn


def test_guard_evaluates_epsilon_rarely_for_constant_schedule():
    acc = create_accountant("rdp")
    guard = BudgetGuard(acc, max_epsilon=3.0, delta=1e-5, sample_rate=0.05)
    assert guard.remaining_steps(2.0, 0.05) > 80
    first = guard.evaluations
    for _ in range(80):
        guard.check(2.0, 0.05)
        acc.step(noise_multiplier=2.0, sample_rate=0.05)
    assert guard.evaluations == first  # cached: no ε computation after the first search
    assert first <= 2 * 12  # exponential search + bisection


def test_guard_recomputes_when_sigma_changes():
    acc = create_accountant("rdp")
    guard = BudgetGuard(acc, max_epsilon=2.0, delta=1e-5, sample_rate=0.1)
    for _ in range(5):
        guard.check(1.5, 0.1)
        acc.step(noise_multiplier=1.5, sample_rate=0.1)
    high = guard.remaining_steps(3.0, 0.1)
    assert high > 16  # larger σ: more steps than the 16 left at σ = 1.5
    oracle = create_accountant("rdp")
    for sigma, steps in ((1.5, 5), (3.0, high)):
        for _ in range(steps):
            oracle.step(noise_multiplier=sigma, sample_rate=0.1)
    assert oracle.get_epsilon(1e-5) <= 2.0
    oracle.step(noise_multiplier=3.0, sample_rate=0.1)
    assert oracle.get_epsilon(1e-5) > 2.0


def test_with_extra_steps_equals_stepping():
    acc = create_accountant("rdp")
    acc.step(noise_multiplier=2.0, sample_rate=0.1)
    copy = with_extra_steps(acc, 1.0, 0.1, 7)
    stepped = create_accountant("rdp")
    stepped.step(noise_multiplier=2.0, sample_rate=0.1)
    for _ in range(7):
        stepped.step(noise_multiplier=1.0, sample_rate=0.1)
    assert len(acc) == 1
    assert copy.get_epsilon(1e-5) == pytest.approx(stepped.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize(
    "base, now, expected",
    [
        ([], [(1.0, 0.1, 3)], 3),
        ([(1.0, 0.1, 2)], [(1.0, 0.1, 5)], 3),
        ([(2.0, 0.1, 2)], [(2.0, 0.1, 2), (1.0, 0.1, 4)], 4),
        ([(2.0, 0.1, 2)], [(2.0, 0.1, 3)], None),
        ([(1.0, 0.1, 2)], [(1.0, 0.1, 1)], None),
        ([(1.0, 0.1, 2)], [(3.0, 0.1, 2)], None),
    ],
)
def test_steps_added(base, now, expected):
    assert steps_added(base, now, 1.0, 0.1) == expected


def test_classic_engine_budget_guard():
    model = small_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    alphas = [2, 4, 8, 16, 32, 64]
    engine = PrivacyEngine(model, 3, 12, alphas=alphas, noise_multiplier=1.0, max_grad_norm=1.0,
                           target_delta=1e-5, max_epsilon=8.0)
    with pytest.warns(SamplingWarning, match="poisson=False"):  # shuffled fixed-size batches
        engine.attach(optimizer)
    x, y = small_loader(n=3, batch_size=3).dataset.tensors
    with pytest.raises(PrivacyBudgetExceededError):
        for _ in range(500):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    assert engine.steps >= 10 and engine.get_privacy_spent()[0] <= 8.0
    acc = create_accountant("rdp")
    acc.load_state_dict(engine.accountant.state_dict())
    acc.step(noise_multiplier=1.0, sample_rate=0.25)
    assert acc.get_privacy_spent(delta=1e-5, alphas=alphas)[0] > 8.0


def test_guard_never_allows_a_step_above_max_epsilon_across_the_prv_method_switch():
    """PRV's ε drops by ~1e-4 where it switches to the tilted composition (δ = T·1e-14, here
    after 10 000 steps): the search used to allow steps 9 999 and 10 000 although the
    accountant then reported ε above the budget.  Oracle: the accountant's own ε after each step."""
    sigma, q, max_eps, delta = 1.0, 0.01, 9.3175, 1e-10
    acc = create_accountant("prv")
    acc.load_state_dict({"history": [(sigma, q, 9993)], "mechanism": "prv"})
    guard = BudgetGuard(acc, max_epsilon=max_eps, delta=delta, sample_rate=q)
    with pytest.raises(PrivacyBudgetExceededError):
        for _ in range(12):
            guard.check(sigma, q)
            acc.step(noise_multiplier=sigma, sample_rate=q)
            assert acc.get_epsilon(delta) <= max_eps
    refused = create_accountant("prv")
    refused.history = [(sigma, q, len(acc) + 1)]
    assert refused.get_epsilon(delta) > max_eps  # the refused step really exceeds the budget


class _DippingAccountant:
    """ε(T) = T/1000, lowered by 0.0015 from T = 500 on (a non-monotone numerical accountant)."""

    def __init__(self):
        self.history = []

    def get_epsilon(self, delta):
        steps = sum(n for _, _, n in self.history)
        return steps / 1000 - (0.0015 if steps >= 500 else 0.0)

    def step(self, *, noise_multiplier, sample_rate):
        if self.history:
            self.history[-1] = (noise_multiplier, sample_rate, self.history[-1][2] + 1)
        else:
            self.history.append((noise_multiplier, sample_rate, 1))

    def __len__(self):
        return sum(n for _, _, n in self.history)


def test_guard_checks_every_step_near_the_budget_exactly():
    """Budget 0.4987: step 498 (ε 0.498) fits, step 499 (0.499) does not, although 500 (0.4985)
    would; a guard trusting a bisection that lands on 500 lets step 499 through."""
    acc = _DippingAccountant()
    acc.history = [(1.0, 0.1, 490)]
    guard = BudgetGuard(acc, max_epsilon=0.4987, delta=1e-5, sample_rate=0.1)
    with pytest.raises(PrivacyBudgetExceededError):
        for _ in range(20):
            guard.check(1.0, 0.1)
            acc.step(noise_multiplier=1.0, sample_rate=0.1)
            assert acc.get_epsilon(1e-5) <= 0.4987
    assert len(acc) == 498


@pytest.mark.parametrize("clipping", ["flat", "adaptive"])
def test_refused_step_inside_batch_memory_manager_drops_its_whole_logical_batch(clipping):
    """The guard refuses the last piece's step of a logical batch; the user raises σ and goes
    on. The next step must be that of its own batch alone: the refused batch's earlier pieces
    (clipped sums, unclipped count) are dropped. Oracle: autograd per-sample gradients of the
    next logical batch, clipped by hand, plus the noise replayed from the generator's state."""
    from opacus_dp.data import BatchMemoryManager
    from tests.distributed.oracle import clipped_sum, per_sample_grads

    model = small_model()
    engine = PrivacyEngine(accountant="rdp", max_epsilon=3.0, max_epsilon_delta=1e-5)
    extra = {"unclipped_num_std": 5.0} if clipping == "adaptive" else {}
    gsm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=small_loader(n=60, batch_size=20), noise_multiplier=1.0, max_grad_norm=0.5,
        clipping=clipping, **extra)
    generator = opt.noise.generator_for(torch.device("cpu"))
    refused, pieces, checked = False, [], False
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as physical:
        for _ in range(60):
            for x, y in physical:
                pieces.append((x, y))
                opt.zero_grad()
                nn.functional.cross_entropy(gsm(x), y).backward()
                recorded, noise_state, bound = len(engine.accountant), generator.get_state(), opt.max_grad_norm
                before = [p.detach().clone() for p in model.parameters()]
                try:
                    opt.step()
                except PrivacyBudgetExceededError:
                    assert len(pieces) > 1, "the refused batch must have earlier pieces"
                    refused, pieces = True, []
                    opt.noise_multiplier = opt.noise_multiplier * 1.5
                    continue
                if len(engine.accountant) == recorded:
                    continue
                if refused and sum(len(px) for px, _ in pieces):
                    got = [p.detach().clone() for p in model.parameters()]
                    oracle = small_model()
                    with torch.no_grad():
                        for p, b in zip(oracle.parameters(), before):
                            p.copy_(b)
                    xs, ys = torch.cat([px for px, _ in pieces]), torch.cat([py for _, py in pieces])
                    params = list(oracle.parameters())
                    summed = clipped_sum(per_sample_grads(oracle, nn.CrossEntropyLoss(), xs, ys), bound, params)
                    replay = torch.Generator()
                    replay.set_state(noise_state)
                    std = opt.clipper.gradient_noise_multiplier(opt.noise_multiplier) * bound
                    expected = [b - (s + torch.normal(0.0, std, size=p.shape, generator=replay, dtype=p.dtype))
                                / opt.expected_batch_size for p, s, b in zip(params, summed, before)]
                    checked = True
                    break
                pieces = []
            if checked:
                break
    assert checked, "a refusal followed by a completed step must have happened"
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, value", [("max_epsilon", 1.0), ("max_epsilon_delta", 1e-3)])
def test_a_budget_set_on_the_engine_after_make_private_is_refused(name, value):
    """make_private hands the guard its ε and δ: ``engine.max_epsilon = 1.0`` afterwards would leave
    the guard at 8.0 (training past ε = 1 without an error), so it is refused; the value given
    before make_private is the guard's, and setting it again to that value is allowed."""
    engine = PrivacyEngine(accountant="rdp", max_epsilon=8.0, max_epsilon_delta=1e-5)
    engine.max_epsilon = 8.0  # before make_private: free
    model = small_model()
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                        data_loader=small_loader(n=12, batch_size=3), noise_multiplier=1.0, max_grad_norm=1.0)
    kept = getattr(engine, name)
    with pytest.raises(AttributeError, match=f"{name} was read when the private step was built.*before make_private"):
        setattr(engine, name, value)
    setattr(engine, name, kept)
    assert getattr(engine, name) == kept
