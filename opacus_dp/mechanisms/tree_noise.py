"""Tree aggregation (:mod:`~opacus_dp.mechanisms.tree`): ``z_t = w_t − Σ_{l<j}`` (the open
nodes of the levels below ``j``), ``j`` the trailing zeros of ``t + 1``; ``w_t`` opens the node
of level ``j``.

The history holds, per slot, the open nodes by level, lowest first: ``history[slot][level]``
(at most ``⌊log₂ n⌋ + 1`` of them).
"""

from opacus_dp.mechanisms import tree
from opacus_dp.mechanisms.strategies import Strategy


class TreeRecursion:
    """:class:`~opacus_dp.mechanisms.recursion.Recursion` of tree aggregation (module doc)."""

    limited_to_planned_steps = True  # the sensitivity counts the nodes inside the planned steps

    def __init__(self, strategy: Strategy):
        pass

    def correct(self, w, slot, history, step_index):
        """``w −`` the nodes that close now; the draw ``w`` is kept (the node it opens)."""
        z = w.clone()
        for node in history[slot][:tree.trailing_zeros(step_index + 1)] if history else ():
            z.sub_(node)
        return z, w

    def commit(self, history, pending, step_index):
        closing = tree.trailing_zeros(step_index + 1)
        return [[w] + (history[slot][closing:] if history else []) for slot, w in enumerate(pending)]
