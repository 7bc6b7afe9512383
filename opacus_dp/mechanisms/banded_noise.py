"""Banded ``C`` (``c_k = 0`` for ``k ≥ b``): ``z_t = w_t − Σ_{k=1}^{b−1} c_k z_{t−k}``.

The history is the noise of the last ``b − 1`` steps, oldest first: ``history[i][slot]``.
"""

from opacus_dp.mechanisms.strategies import Strategy


class BandedRecursion:
    """:class:`~opacus_dp.mechanisms.recursion.Recursion` of a banded strategy (module doc)."""

    limited_to_planned_steps = False  # the bands apply to any number of steps

    def __init__(self, strategy: Strategy):
        self.coefficients = strategy.coefficients
        self.kept_steps = strategy.bands - 1

    def correct(self, w, slot, history, step_index):
        z = w.clone()
        for k, past in enumerate(reversed(history), start=1):
            z.sub_(past[slot], alpha=self.coefficients[k])
        return z.clone(), z

    def commit(self, history, pending, step_index):
        history.append(pending)
        del history[:max(0, len(history) - self.kept_steps)]
        return history
