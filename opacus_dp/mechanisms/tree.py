"""Tree aggregation (DP-FTRL; Kairouz et al. 2021, "Practical and Private (Deep) Learning without
Sampling or Shuffling"; Dwork et al. 2010, Chan et al. 2011).

Every dyadic block ``[m·2ˡ, (m+1)·2ˡ)`` inside the ``n`` steps is a node with its own draw
``w ~ N(0, σ²C_clip²Δ²)``; the noise of the prefix sum of the first ``L`` steps is the sum of the
nodes of the binary decomposition of ``L`` (``popcount(L)`` nodes). In DP-SGD form step ``t``
gets ``z_t = N_{t+1} − N_t = w_new − Σ_{l < j} w_l``, ``j`` the number of trailing zeros of
``t + 1``: the nodes of levels below ``j`` close and the new node of level ``j`` opens, so at most
``⌊log₂ n⌋ + 1`` buffers are kept (:mod:`~opacus_dp.mechanisms.tree_noise`).

Sensitivity for an example taking part every ``period`` steps (cyclic, residue ``g``):
``Δ² = max_g Σ_nodes |{its steps in the node}|²`` (a sum of squares over the node vectors,
exact: every node is one coordinate of ``C x``). The mean squared error of the prefix sums,
per coordinate in units of ``(σ C_clip)²``, is ``Δ² · mean_{L≤n} popcount(L)``. No
amplification is claimed (accounting: :mod:`~opacus_dp.mechanisms.accounting`).
"""

import numpy as np


def levels(n: int) -> int:
    """Number of node levels, ``⌊log₂ n⌋ + 1``."""
    return int(n).bit_length()


def sensitivity(n: int, period: int) -> float:
    """``Δ`` of the module doc."""
    period = min(period, n)
    worst = 0.0
    for g in range(period):
        steps = np.arange(g, n, period)
        total = 0.0
        for level in range(levels(n)):
            complete = (n >> level) << level  # nodes end at or before n
            counts = np.bincount(steps[steps < complete] >> level)
            total += float((counts.astype(np.float64) ** 2).sum())
        worst = max(worst, total)
    return float(np.sqrt(worst))


def mean_nodes(n: int) -> float:
    """``mean_{L=1..n} popcount(L)``: nodes summed per prefix."""
    return float(np.mean([bin(length).count("1") for length in range(1, n + 1)]))


def trailing_zeros(value: int) -> int:
    """Trailing zero bits of ``value > 0``."""
    return (value & -value).bit_length() - 1
