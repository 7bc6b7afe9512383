"""Noise calibration for a user-level budget of example-level DP-SGD.

The user-level ε of a run (σ, q, T) is the group-privacy bound of
:func:`~opacus_dp.accountants.group_privacy.user_level_epsilon` applied to the accountant's curve
ε(δ'); it decreases with σ (more noise lowers ε(δ') at every δ' and so enlarges the feasible set).
The σ search is the one of :func:`~opacus_dp.accountants.calibration.get_noise_multiplier`, which
keeps an upper end whose ε is at most the target and returns it: the result never spends more
than the user-level budget (for the chosen accountant).
"""

from typing import Optional

from opacus_dp.accountants.calibration import calibration_inputs, search_sigma
from opacus_dp.accountants.group_privacy import check_group_size
from opacus_dp.accountants.registry import create_accountant


def user_level_epsilon_of_run(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                              max_examples_per_user: int, accountant: str = "rdp", **epsilon_kwargs):
    """``(ε_user, δ')`` of ``steps`` steps of (σ, q) for users with at most k examples;
    ``epsilon_kwargs`` go to the accountant's ``get_epsilon`` (``alphas``, ``eps_error``)."""
    example_level = create_accountant(accountant)
    example_level.history = [(noise_multiplier, sample_rate, steps)]
    return example_level.get_user_level_epsilon(delta, max_examples_per_user, **epsilon_kwargs)


def get_user_level_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    max_examples_per_user: int,
    sample_rate: float,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "rdp",
    epsilon_tolerance: float = 0.01,
    **epsilon_kwargs,
) -> float:
    """σ such that ``target − tol/2 < ε_user(σ) ≤ target`` at ``target_delta`` for users with at
    most ``max_examples_per_user`` examples, ``tol = epsilon_tolerance × min(1, target_epsilon)``
    (the tolerance of :func:`~opacus_dp.accountants.calibration.get_noise_multiplier`, which this
    equals for k = 1). Raises ``ValueError`` when even σ = 10⁶ exceeds the budget."""
    target, delta, q, count = calibration_inputs(target_epsilon=target_epsilon, target_delta=target_delta,
                                                 sample_rate=sample_rate, epochs=epochs, steps=steps,
                                                 accountant=accountant, epsilon_tolerance=epsilon_tolerance)
    k = check_group_size(max_examples_per_user)

    def eps(sigma: float) -> float:
        return user_level_epsilon_of_run(noise_multiplier=sigma, sample_rate=q, steps=count, delta=delta,
                                         max_examples_per_user=k, accountant=accountant, **epsilon_kwargs)[0]

    return search_sigma(eps, target, epsilon_tolerance * min(1.0, target) / 2)
