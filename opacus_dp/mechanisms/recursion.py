"""The streaming recursion ``z = C⁻¹ w`` of a correlated-noise kind, one step at a time.

:class:`~opacus_dp.mechanisms.noise.CorrelatedNoise` keeps the shared parts (drawing ``w``,
committing at the next step, discarding a refused step, checkpoints) and asks the
:class:`Recursion` of its strategy's kind for the rest. ``history`` is the state kept between
steps, a list of lists of tensors whose layout each kind chooses (it is saved as the
checkpoint's ``buffers``); a recursion never keeps it itself.
"""

from typing import List, Optional, Protocol, Tuple

import torch

History = List[List[torch.Tensor]]


class Recursion(Protocol):
    """How one kind turns the draws ``w_t`` into the noise ``z_t`` (``C z = w``, ``c₀ = 1``)."""

    limited_to_planned_steps: bool
    """True when ``C`` is only defined for the strategy's ``steps`` (no step may follow them)."""

    def correct(self, w: torch.Tensor, slot: int, history: History,
                step_index: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(z_t, kept)`` for tensor ``slot`` of step ``step_index``: the noise to add (the
        caller may change it in place) and what :meth:`commit` receives of it (None: nothing)."""

    def commit(self, history: History, pending: List[torch.Tensor], step_index: int) -> History:
        """The history after step ``step_index``, ``pending`` its kept tensors by slot."""


class IndependentRecursion:
    """``C = I``: ``z_t = w_t``, DP-SGD's draws bit for bit; nothing is kept. Also the
    recursion of any kind's strategy with one band (``limited_to_planned_steps``: the kind's)."""

    limited_to_planned_steps = False

    def __init__(self, strategy=None, limited_to_planned_steps: bool = False):
        self.limited_to_planned_steps = limited_to_planned_steps

    def correct(self, w, slot, history, step_index):
        return w, None

    def commit(self, history, pending, step_index):
        return history
