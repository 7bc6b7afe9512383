"""``examples/user_level.py``: the writers split, and both ways to a per-writer ε, end to end.

The printed user-level ε is checked against computations that do not use the example's code path:
for ULS the run's (σ, q, T) replayed into opacus_dp's accountant and into Opacus's (the writers'
rate is the q of the guarantee); for ELS the group-privacy bound by hand on Google
``dp-accounting``'s RDP curve ε(δ') of the same run.
"""

import math

import pytest
import torch

from tests.examples.example_runs import (
    SECURE_MODE_WARNING,
    assert_epsilon_consistent,
    assert_history,
    example_module,
    printed_epsilon,
    read_json,
    run_example,
)

pytestmark = pytest.mark.filterwarnings(SECURE_MODE_WARNING)

TRAIN_SIZE = 1437  # 80 % of sklearn's 1,797 digits
FEW_STEPS = ["--epochs", "1", "--sample-rate", "0.5", "--target-epsilon", "4"]  # 2 steps


def _writers():
    module = example_module("user_level")  # puts examples/ on sys.path for ``common``
    from common import writers

    return module, writers


def test_writers_follow_the_public_rule():
    _, writers = _writers()
    labels = torch.arange(TRAIN_SIZE) % 10
    ids = writers.assign_writers(labels)
    assert torch.equal(ids, writers.assign_writers(labels))  # fixed: no randomness
    assert ids.unique().tolist() == list(range(60))
    relabelled = labels.clone()
    relabelled[1:] = (relabelled[1:] + 3) % 10  # example 0's writer depends on its own position and label only
    assert writers.assign_writers(relabelled)[0] == ids[0]
    favoured = [int(y) in writers.favourite_classes(int(w)) for w, y in zip(ids, labels)]
    # 80 % placed with a writer who favours the label, and 2 in 10 of the other 20 % by chance: ≈ 84 %
    assert abs(sum(favoured) / TRAIN_SIZE - 0.84) < 0.04  # binomial sd ≈ 0.01
    for w in range(60):
        a, b = writers.favourite_classes(w)
        assert a != b and a == w % 10


def test_cap_keeps_the_first_k_of_every_writer():
    _, writers = _writers()
    ids = torch.tensor([3, 1, 3, 3, 2, 1, 3, 1, 1])
    kept = writers.cap_per_writer(ids, 2)
    assert kept.tolist() == [0, 1, 2, 4, 5]  # writer 3: rows 0, 2; writer 1: rows 1, 5; writer 2: row 4


def test_user_level_sampling_reports_the_accountants_epsilon_per_writer(tmp_path, capsys):
    path = tmp_path / "uls.json"
    out = run_example("user_level", ["--privacy-unit", "user", *FEW_STEPS, "--json", path], capsys)
    summary = read_json(path)
    assert summary["train_size"] == TRAIN_SIZE and summary["writers"] == 60
    assert_history(summary, sigma=summary["noise_multiplier"], sample_rate=0.5, steps=2)
    epsilon = assert_epsilon_consistent(out, summary)  # (σ, q_writers, 2) in opacus_dp and Opacus
    assert 3.9 < epsilon <= 4.0  # calibrated per writer
    assert f"sigma={summary['noise_multiplier']!r} q=0.5" in out and "unit=user k=8" in out
    assert "per writer" in out and 0.0 <= summary["test_accuracy"] <= 1.0


def _rdp_curve(sigma: float, q: float, steps: int):
    """δ' ↦ ε(δ') of ``steps`` Poisson-subsampled Gaussian steps (Google ``dp-accounting``, RDP)."""
    from dp_accounting import dp_event, rdp

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512, 1024]
    accountant = rdp.RdpAccountant(orders)
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), steps)
    return accountant.get_epsilon


@pytest.mark.parametrize("k", [1, 4])
def test_example_level_sampling_converts_by_group_privacy(tmp_path, capsys, k):
    path = tmp_path / "els.json"
    argv = ["--privacy-unit", "example", "--max-examples-per-user", k, "--accountant", "rdp", *FEW_STEPS]
    out = run_example("user_level", argv + ["--json", path], capsys)
    summary = read_json(path)
    sigma, delta = summary["noise_multiplier"], 1e-5
    assert summary["train_size"] == (60 if k == 1 else 240)  # every writer has ≥ 4 digits
    assert_history(summary, sigma=sigma, sample_rate=0.5, steps=2)
    shown = printed_epsilon(out)
    assert 3.9 < shown <= 4.0
    eps_example, delta_example = summary["example_epsilon"], summary["example_delta"]
    epsilon_at = _rdp_curve(sigma, 0.5, 2)
    # the point (ε', δ') is the run's example-level guarantee by an independent accountant ...
    assert eps_example == pytest.approx(epsilon_at(delta_example), rel=2e-2)
    # ... and the group bound by hand: (k ε', δ' Σ_{i<k} e^{iε'}) with the sum within δ
    assert shown == pytest.approx(k * eps_example, rel=1e-5)
    assert delta_example * sum(math.exp(i * eps_example) for i in range(k)) <= delta * (1 + 1e-9)
    # no δ' on a grid gives a smaller feasible k·ε(δ') (up to the accountants' difference)
    grid = [10.0 ** (-e / 4) for e in range(20, 240)]
    feasible = [k * e for d in grid for e in [epsilon_at(d)]
                if d * sum(math.exp(i * e) for i in range(k)) <= delta]
    assert shown <= min(feasible) * 1.02
    assert f"by group privacy over k = {k} digits" in out


def test_bad_flags_are_refused(capsys):
    for argv in (["--epochs", "0"], ["--sample-rate", "1.5"], ["--writers", "5"]):
        with pytest.raises(SystemExit) as exit_info:
            run_example("user_level", argv, capsys)
        assert exit_info.value.code == 2
