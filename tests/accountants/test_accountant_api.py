"""Common accountant behaviour: history, merging, length, state_dict, registry, bad input."""

import math
import pickle
import warnings

import pytest

from opacus_dp.accountants import (
    GaussianAccountant,
    PRVAccountant,
    PrivacyAccountant,
    RDPAccountant,
    available_accountants,
    create_accountant,
    register_accountant,
)

NAMES = ["rdp", "prv", "gdp"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def test_registry_creates_each_kind_and_rejects_unknown_names():
    assert isinstance(create_accountant("rdp"), RDPAccountant)
    assert isinstance(create_accountant("prv"), PRVAccountant)
    assert isinstance(create_accountant("gdp"), GaussianAccountant)
    assert set(NAMES) <= set(available_accountants())
    with pytest.raises(ValueError, match="unknown accountant 'moments'"):
        create_accountant("moments")


def test_register_accountant_requires_force_to_replace():
    class Custom(RDPAccountant):
        @classmethod
        def mechanism(cls):
            return "custom-test"

    register_accountant("custom-test", Custom)
    assert isinstance(create_accountant("custom-test"), Custom)
    with pytest.raises(ValueError, match="force=True"):
        register_accountant("custom-test", Custom)
    register_accountant("custom-test", Custom, force=True)
    with pytest.raises(TypeError):
        register_accountant("not-a-class", object)


@pytest.mark.parametrize("name", NAMES)
def test_history_merges_consecutive_equal_steps_and_len_counts_steps(name):
    accountant = create_accountant(name)
    for sigma, q in [(1.0, 0.01)] * 3 + [(1.2, 0.01)] * 2 + [(1.0, 0.01)]:
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert accountant.history == [(1.0, 0.01, 3), (1.2, 0.01, 2), (1.0, 0.01, 1)]
    assert len(accountant) == 6
    assert accountant.mechanism() == name


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip_gives_same_epsilon(name):
    accountant = create_accountant(name)
    accountant.history = [(1.0, 0.02, 50), (1.5, 0.01, 30)]
    state = pickle.loads(pickle.dumps(accountant.state_dict()))
    restored = create_accountant(name)
    restored.load_state_dict(state)
    assert restored.history == accountant.history
    assert restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    restored.step(noise_multiplier=1.5, sample_rate=0.01)
    assert accountant.history[-1] == (1.5, 0.01, 30), "state_dict must be a copy"


@pytest.mark.parametrize("source,target", [("rdp", "prv"), ("prv", "gdp"), ("gdp", "rdp")])
def test_another_mechanisms_state_is_refused_as_in_opacus(source, target):
    """Opacus 1.6 raises ValueError for another accountant type's state; the history itself
    can still be recomputed by assigning it (what the message says)."""
    accountant = create_accountant(source)
    accountant.history = [(1.1, 0.01, 500), (0.9, 0.02, 100)]
    loaded, fresh = create_accountant(target), create_accountant(target)
    with pytest.raises(ValueError, match=f"'{source}' accountant cannot be loaded into a '{target}'"):
        loaded.load_state_dict(accountant.state_dict())
    assert loaded.history == []
    loaded.history = list(accountant.state_dict()["history"])
    for sigma, q, steps in accountant.history:
        for _ in range(steps):
            fresh.step(noise_multiplier=sigma, sample_rate=q)
    assert loaded.history == fresh.history
    assert loaded.get_epsilon(1e-5) == fresh.get_epsilon(1e-5)


def test_loading_a_malformed_state_is_refused():
    accountant = RDPAccountant()
    for empty in ({}, None):
        with pytest.raises(ValueError, match="empty"):
            accountant.load_state_dict(empty)
    for partial in ({"1": 2}, {"history": []}, {"mechanism": "rdp"}):
        with pytest.raises(ValueError, match="lacks the key"):
            accountant.load_state_dict(partial)
    with pytest.raises(ValueError, match=r"history\[0\]"):
        accountant.load_state_dict({"history": [(1.0, 0.1)], "mechanism": "rdp"})
    with pytest.raises(ValueError, match=r"history\[0\] sample_rate"):
        accountant.load_state_dict({"history": [(1.0, 2.0, 3)], "mechanism": "rdp"})


def test_loads_an_opacus_state_dict():
    from opacus.accountants import RDPAccountant as OpacusRDP

    theirs = OpacusRDP()
    for _ in range(10):
        theirs.step(noise_multiplier=1.1, sample_rate=0.01)
    ours = RDPAccountant()
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_epsilon(1e-5) == pytest.approx(theirs.get_epsilon(1e-5), rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_bad_step_and_delta_values_name_the_argument(name):
    accountant = create_accountant(name)
    with pytest.raises(ValueError, match="noise_multiplier"):
        accountant.step(noise_multiplier=-0.1, sample_rate=0.1)
    with pytest.raises(ValueError, match="sample_rate"):
        accountant.step(noise_multiplier=1.0, sample_rate=1.5)
    with pytest.raises(ValueError, match="sample_rate"):
        accountant.step(noise_multiplier=1.0, sample_rate=-0.1)
    with pytest.raises(TypeError, match="noise_multiplier"):
        accountant.step(noise_multiplier="1.0", sample_rate=0.1)
    accountant.step(noise_multiplier=1.0, sample_rate=0.1)
    for delta in (0.0, 1.0, -1e-5, 2.0):
        with pytest.raises(ValueError, match="delta"):
            accountant.get_epsilon(delta)
    assert accountant.history == [(1.0, 0.1, 1)], "a refused step must not be recorded"


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_zero_rate_histories_cost_nothing(name):
    accountant = create_accountant(name)
    assert accountant.get_epsilon(1e-5) == 0.0
    accountant.history = [(1.0, 0.0, 1000)]
    assert accountant.get_epsilon(1e-5) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_no_noise_means_infinite_epsilon(name):
    accountant = create_accountant(name)
    accountant.history = [(1.0, 0.01, 10), (0.0, 0.01, 1)]
    assert accountant.get_epsilon(1e-5) == math.inf


def test_get_privacy_spent_returns_best_order_only_for_rdp():
    rdp = RDPAccountant()
    rdp.history = [(1.0, 0.01, 100)]
    eps, order = rdp.get_privacy_spent(delta=1e-5)
    assert eps == rdp.get_epsilon(1e-5) and order in RDPAccountant.DEFAULT_ALPHAS
    prv = PRVAccountant()
    prv.history = [(1.0, 0.01, 100)]
    assert prv.get_privacy_spent(delta=1e-5) == (prv.get_epsilon(1e-5), None)


def test_rdp_accountant_uses_the_orders_given_at_construction():
    accountant = RDPAccountant(alphas=[2, 4, 8, 16, 32])
    accountant.history = [(1.0, 0.01, 100)]
    eps, order = accountant.get_privacy_spent(delta=1e-5)
    assert order in (2, 4, 8, 16, 32)
    assert accountant.get_epsilon(1e-5, alphas=[3]) == pytest.approx(accountant.get_privacy_spent(delta=1e-5, alphas=[3])[0])
    with pytest.raises(ValueError, match="alphas"):
        RDPAccountant(alphas=[0.5, 2])


def test_gdp_warns_that_it_is_an_approximation():
    with pytest.warns(UserWarning, match="central limit theorem"):
        GaussianAccountant()


def test_optimizer_hook_records_the_optimizer_noise():
    class FakeOptimizer:
        noise_multiplier = 1.3
        accumulated_iterations = 2

    accountant = RDPAccountant()
    hook = accountant.get_optimizer_hook_fn(sample_rate=0.01)
    hook(FakeOptimizer())
    hook(FakeOptimizer())
    assert accountant.history == [(1.3, 0.02, 2)]


def test_every_accountant_is_a_privacy_accountant():
    for name in NAMES:
        assert isinstance(create_accountant(name), PrivacyAccountant)


@pytest.mark.parametrize("mechanism", ["rdp", "prv", "gdp"])
def test_step_count_beyond_int64_is_refused_with_its_name(mechanism):
    """10²⁰ steps cannot be turned into a float computation (it used to raise OverflowError)."""
    accountant = create_accountant(mechanism)
    with pytest.raises(ValueError, match=r"history\[0\] num_steps must be at most 2\*\*63 - 1"):
        accountant.load_state_dict({"history": [(1.0, 0.1, 10**20)], "mechanism": mechanism})
