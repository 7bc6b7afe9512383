"""The reducer protocol: how a private step's clipped sums become the released gradient.

One step hands its reducer a :class:`StepRelease` — this process's clipped sums ``S_l`` (and the
count adaptive clipping releases), the noise it may add, the settings every process must share
and this process's refusal, if any — and gets back the released tensors in the same order:

* local (one process, also ``nn.DataParallel``, whose replicas' per-sample gradients are gathered
  by the gradient source): ``S + N``;
* DDP all-reduce (:class:`~opacus_dp.distributed.reducers.AllReduceReducer`): ``Σ_r S_r + N``,
  the noise drawn once, by rank 0;
* FSDP2 reduce-scatter (:class:`~opacus_dp.distributed.reduce_scatter.ReduceScatterReducer`):
  this rank's shard of ``Σ_r S_r``, noised by this rank.

A distributed reducer also decides, in the step's own collective, whether every process agrees on
the settings and whether one refused the step (:mod:`~opacus_dp.optim.step_refusal`). The
optimizer then divides by the expected batch size (``mean``) and lays each tensor out as its
parameter's gradient with :meth:`Reducer.as_grad`.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Sequence, runtime_checkable

import torch

Noise = Callable[[List[torch.Tensor]], List[torch.Tensor]]


def _no_noise(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    return tensors


@dataclass
class StepRelease:
    """What one step releases: ``sums`` (one per trainable tensor of ``params``), the adaptive
    clipping ``count`` (or None), ``noise`` (new tensors ``t + N(0, (σΔ)²)``) and ``count_noise``,
    ``agreed`` (the settings all processes share; None for one process) and ``refusal`` (this
    process's :class:`~opacus_dp.errors.RefusalReason`, or None)."""

    sums: List[torch.Tensor]
    params: Sequence[torch.Tensor] = ()
    count: Optional[torch.Tensor] = None
    noise: Noise = _no_noise
    count_noise: Callable[[torch.Tensor], torch.Tensor] = lambda count: count
    agreed: Optional[Dict[str, float]] = None
    refusal: Optional[int] = None

    def bucket(self, noised: bool) -> List[torch.Tensor]:
        """The sums, then the count as one element like the first sum; noised if ``noised`` (the
        gradient noise first, then the count's, from the same source)."""
        sums, count = self.sums, self.count
        if noised:
            sums = self.noise(sums)
            count = None if count is None else self.count_noise(count)
        if count is None:
            return list(sums)
        like = sums[0] if sums else count
        return list(sums) + [count.reshape(1).to(device=like.device, dtype=like.dtype)]


@runtime_checkable
class Reducer(Protocol):
    """Combines the clipped sums of the processes of one step (module doc)."""

    @property
    def world_size(self) -> int:
        """Processes whose samples form one step (the mean divides by ``E|B| · world_size``)."""

    @property
    def draws_noise(self) -> bool:
        """Whether this process draws noise in the step (the correlated-noise schedule is checked there)."""

    @property
    def shards(self) -> bool:
        """Whether :meth:`reduce` returns this process's shards (FSDP2): the full sums are freed as
        sent, and a released count (adaptive clipping) has no place."""

    @property
    def reuses_input(self) -> bool:
        """Whether :meth:`reduce` overwrites the sums it is given (a view of them must copy first)."""

    @property
    def needs_equal_passes(self) -> bool:
        """Whether every process must run the same forward/backward passes per step (FSDP2)."""

    def reduce(self, release: StepRelease) -> List[torch.Tensor]:
        """The released tensors of the step, in the order of ``release.bucket``."""

    def as_grad(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` laid out as ``param``'s gradient."""

    def close(self) -> None:
        """Remove what the reducer attached to the model."""


class LocalReducer:
    """One process (one replica, or ``nn.DataParallel``): the noised sums are the release."""

    world_size = 1
    draws_noise = True
    shards = False
    reuses_input = False
    needs_equal_passes = False

    def reduce(self, release: StepRelease) -> List[torch.Tensor]:
        """``S + N`` (and the noised count)."""
        return release.bucket(noised=True)

    def close(self) -> None:
        """Nothing attached."""

    @staticmethod
    def as_grad(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` in ``param``'s shape and dtype."""
        return value.view_as(param).to(param.dtype)

    def __repr__(self):
        return "LocalReducer()"
