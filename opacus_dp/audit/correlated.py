"""Membership scores for the correlated-noise mechanisms (``noise_mechanism`` "banded", "blt").

A canary's observations over ``T`` steps are ``x = b + C⁻¹ω`` (:mod:`~opacus_dp.audit.runner`'s
units: a participation adds 1), ``ω ~ N(0, σ²Δ²I)``, ``C`` the strategy's ``T×T`` Toeplitz
matrix, ``Δ`` its sensitivity. The white-box auditor removes the correlation, ``y = C x =
C b + ω``, and tests with the columns ``C[:, s]`` of the steps ``s`` of the canary's group
(known: groups are assigned by index, and the canary's index is fixed by the other canaries):

* group rate ``q_g < 1`` (amplified banded: the columns of one group's steps do not overlap):
  ``score = Σ_s log(1 − q_g + q_g·exp(L_s))``, ``L_s = (⟨C[:, s], y⟩ − ‖C[:, s]‖²/2)/(σ²Δ²)``;
* ``q_g = 1`` (every step of its group): ``score = (⟨u, y⟩ − ‖u‖²/2)/(σ²Δ²)``,
  ``u = Σ_s C[:, s]``.

These are the log-likelihood ratios of the claimed mechanism (the Neyman–Pearson statistic),
so a broken engine (noise that lost its correlation, a sensitivity computed for the wrong
number of bands) shows up as a lower bound above the accountant's ε.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from opacus_dp.mechanisms import toeplitz
from opacus_dp.mechanisms.strategies import Strategy


@dataclass(frozen=True)
class MechanismRecord:
    """What the scores need of a run's mechanism: the ``strategy``, the loader's ``groups`` and
    group rate, and each canary's group."""

    strategy: Strategy
    groups: int
    group_rate: float


def canary_groups(membership: torch.Tensor, assignment: torch.Tensor) -> torch.Tensor:
    """The group of each canary's index (canaries come first, present ones only: a canary's index
    is the number of present canaries before it, whether or not it is present itself)."""
    member = membership.to(torch.int64)
    return assignment[torch.cumsum(member, 0) - member]


def correlated_scores(observations, groups_of_canaries, *, record: MechanismRecord,
                      noise_multiplier: float) -> np.ndarray:
    """``(m,)`` scores of the module doc from ``(T, m)`` observations."""
    if record.strategy.kind not in ("banded", "blt"):
        raise ValueError(f"no audit score for noise_mechanism={record.strategy.kind!r}")
    if not noise_multiplier > 0:
        raise ValueError("auditing a correlated mechanism needs noise_multiplier > 0")
    x = torch.as_tensor(observations, dtype=torch.float64)
    steps = x.shape[0]
    C = toeplitz.dense(record.strategy.column(steps), steps)
    variance = (noise_multiplier * record.strategy.sensitivity) ** 2
    v = C.T @ (C @ x)  # ⟨C[:, s], y⟩ for every step s and canary
    in_group = (torch.arange(steps)[:, None] % record.groups) == torch.as_tensor(groups_of_canaries)[None, :]
    if record.group_rate < 1:
        llr = (v - 0.5 * C.square().sum(0)[:, None]) / variance
        per_step = torch.logaddexp(torch.tensor(math.log1p(-record.group_rate), dtype=torch.float64),
                                   math.log(record.group_rate) + llr)
        return (per_step * in_group).sum(0).numpy()
    u = C @ in_group.to(torch.float64)  # Σ_s C[:, s] per canary
    return (((v * in_group).sum(0) - 0.5 * u.square().sum(0)) / variance).numpy()
