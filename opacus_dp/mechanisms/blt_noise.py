"""Buffered linear Toeplitz ``C`` (``c_k = Σ_i ω_i θ_iᵏ⁻¹``; Dvijotham et al. 2024):
``z_t = w_t − Σ_i ω_i s_{i,t}`` with ``s_{i,t+1} = θ_i s_{i,t} + z_t``, ``s_{i,0} = 0``.

The history is one entry holding, per slot, the ``d`` buffers stacked: ``history[0][slot]``
of shape ``d × shape`` (empty before the first commit).
"""

import torch

from opacus_dp.mechanisms.strategies import Strategy


class BltRecursion:
    """:class:`~opacus_dp.mechanisms.recursion.Recursion` of a BLT strategy (module doc)."""

    limited_to_planned_steps = True  # θ, ω were optimised and accounted for the planned steps

    def __init__(self, strategy: Strategy):
        self.theta, self.omega = (torch.tensor(v, dtype=torch.float64) for v in strategy.blt)

    def correct(self, w, slot, history, step_index):
        z = w.clone()
        if history:
            buffers = history[0][slot]
            z.sub_(torch.tensordot(self.omega.to(buffers), buffers, dims=1))
        return z.clone(), z

    def commit(self, history, pending, step_index):
        return [[self._updated_buffers(history, slot, z) for slot, z in enumerate(pending)]]

    def _updated_buffers(self, history, slot: int, z: torch.Tensor) -> torch.Tensor:
        """``s_i ← θ_i s_i + z`` for all ``i`` (in place on the stacked buffers)."""
        if not history:
            return z.unsqueeze(0).expand(len(self.theta), *z.shape).clone()
        theta = self.theta.to(z).reshape(-1, *([1] * z.dim()))
        return history[0][slot].mul_(theta).add_(z)
