"""Rows of a batch grouped into privacy units, and the queue that carries each batch's grouping
from the loader to the per-sample gradient source.

A *privacy unit* is what the guarantee protects: one example (the default: every row is its own
unit), one user (``privacy_unit="user"``: the rows of one sampled user), or one example seen
through ``K`` augmentations (``augmentation_multiplicity=K``). With rows ``i`` of unit ``u(i)``
and weights ``w_i``, the unit's gradient is

    G_u = Σ_{i: u(i)=u} w_i · g_i,      w_i = 1/n_u ("mean", the default) or 1 ("sum"),

it is clipped as one: ``f_u = min(1, C/‖G_u‖)``, and ``Σ_u f_u G_u = Σ_i (f_{u(i)} w_i) g_i``, so a
clipped sum over units is a clipped sum over rows with the *row factors* ``f_{u(i)} w_i``.

The loader delivers each batch's :class:`UnitGroups` to a :class:`UnitChannel` when the batch
reaches the training loop; the gradient source takes the groupings of the batches its backward
passes saw (the last ones delivered) when the step reads the norms.
"""

import math
from collections import deque
from typing import List, Sequence

import torch

UNIT_GRADIENTS = ("mean", "sum")


class UnitLayoutError(ValueError):
    """The backward passes of a step do not match the batches the unit loader delivered."""


class UnitGroups:
    """The unit of every row of one or more batches (rows of a unit need not be contiguous).

    Args:
        index: ``(B,)`` long, the unit ``u(i) ∈ [0, U)`` of row ``i``.
        num_units: ``U``.
        weights: ``(B,)`` float64, the row weights ``w_i``.
    """

    def __init__(self, index: torch.Tensor, num_units: int, weights: torch.Tensor, unit_gradient: str = "mean"):
        self.index = index
        self.num_units = int(num_units)
        self.weights = weights
        self.unit_gradient = unit_gradient

    @classmethod
    def from_sizes(cls, sizes: Sequence[int], unit_gradient: str = "mean") -> "UnitGroups":
        """Units of ``sizes[u]`` consecutive rows each, in order."""
        if unit_gradient not in UNIT_GRADIENTS:
            raise ValueError(f"unit_gradient must be one of {UNIT_GRADIENTS}, got {unit_gradient!r}")
        counts = torch.tensor([int(s) for s in sizes], dtype=torch.long)
        if bool((counts < 1).any()):
            raise ValueError(f"every unit needs at least one row, got sizes {list(sizes)}")
        index = torch.repeat_interleave(torch.arange(len(counts)), counts)
        per_unit = 1.0 / counts.double() if unit_gradient == "mean" else torch.ones(len(counts), dtype=torch.float64)
        return cls(index, len(counts), per_unit[index], unit_gradient)

    @classmethod
    def concat(cls, groups: Sequence["UnitGroups"]) -> "UnitGroups":
        """The groupings of consecutive batches as one (units stay apart: offsets added)."""
        if not groups:
            return cls(torch.zeros(0, dtype=torch.long), 0, torch.zeros(0, dtype=torch.float64))
        index, total = [], 0
        for g in groups:
            index.append(g.index + total)
            total += g.num_units
        return cls(torch.cat(index), total, torch.cat([g.weights for g in groups]), groups[0].unit_gradient)

    @property
    def num_rows(self) -> int:
        return int(self.index.shape[0])

    def sizes(self) -> List[int]:
        """Rows per unit."""
        return torch.bincount(self.index, minlength=self.num_units).tolist()

    def unit_sums(self, grads: torch.Tensor) -> torch.Tensor:
        """``G_u = Σ_{i∈u} w_i g_i``: ``(B, *shape) -> (U, *shape)``, in the dtype of ``grads``."""
        self._check_rows(grads)
        shape = (-1,) + (1,) * (grads.dim() - 1)
        weighted = grads * self.weights.to(grads.device, grads.dtype).view(shape)
        out = grads.new_zeros((self.num_units, *grads.shape[1:]))
        return out.index_add_(0, self.index.to(grads.device), weighted)

    def sq_norms(self, grads: torch.Tensor) -> torch.Tensor:
        """``‖G_u‖²`` of every unit, ``(U,)``, from per-row gradients ``(B, *shape)``."""
        sums = self.unit_sums(grads)
        return sums.reshape(self.num_units, math.prod(sums.shape[1:])).square().sum(dim=1)

    def row_factors(self, unit_factors: torch.Tensor) -> torch.Tensor:
        """``f_{u(i)} · w_i`` of every row, for the unit factors ``f_u`` (shape ``(U,)``)."""
        if unit_factors.shape[0] != self.num_units:
            raise UnitLayoutError(f"{unit_factors.shape[0]} factors for {self.num_units} privacy units")
        index = self.index.to(unit_factors.device)
        return unit_factors[index] * self.weights.to(unit_factors.device, unit_factors.dtype)

    def _check_rows(self, grads: torch.Tensor) -> None:
        if grads.shape[0] != self.num_rows:
            raise UnitLayoutError(
                f"per-sample gradients have {grads.shape[0]} rows but the batch the loader delivered "
                f"has {self.num_rows}")


MISMATCH = ("the backward passes of this step saw {seen} rows, but the last batches the privacy-unit "
            "loader delivered have {delivered}: with privacy_unit='user' or augmentation_multiplicity, "
            "every backward pass must be over a batch of that loader (or of the BatchMemoryManager "
            "over it), unchanged (no rows added, dropped or reordered)")


class UnitChannel:
    """Groupings of the batches delivered to the training loop, newest last (module doc)."""

    def __init__(self, keep: int = 64):
        self._delivered: deque = deque(maxlen=keep)

    def deliver(self, groups: UnitGroups) -> None:
        """A batch with rows grouped as ``groups`` reached the training loop."""
        self._delivered.append(groups)

    def clear(self) -> None:
        self._delivered.clear()

    def latest(self):
        """The grouping of the batch delivered last (None if none is waiting for a step)."""
        return self._delivered[-1] if self._delivered else None

    def take(self, batch_sizes: Sequence[int]) -> List[UnitGroups]:
        """The groupings of the last ``len(batch_sizes)`` delivered batches, checked against the
        rows of the backward passes (oldest first); batches delivered before them never reached a
        backward pass and are dropped."""
        batch_sizes = [int(b) for b in batch_sizes]
        delivered = list(self._delivered)[-len(batch_sizes):] if batch_sizes else []
        sizes = [g.num_rows for g in delivered]
        if sizes != batch_sizes:
            raise UnitLayoutError(MISMATCH.format(seen=batch_sizes, delivered=sizes or "none"))
        self._delivered.clear()
        return delivered

    def take_rows(self, num_rows: int, passes: int) -> UnitGroups:
        """:meth:`take` for ``passes`` backward passes of ``num_rows`` rows in all (a source that
        concatenates its passes)."""
        passes = max(int(passes), 1)
        delivered = list(self._delivered)[-passes:]
        return UnitGroups.concat(self.take([g.num_rows for g in delivered]
                                           if sum(g.num_rows for g in delivered) == num_rows else [num_rows]))
