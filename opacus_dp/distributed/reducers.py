"""Reducers: how the DP optimizer combines the clipped gradient sums of several processes.

The reducer protocol is :class:`~opacus_dp.optim.reduction.Reducer`: at each (non-virtual) step
the optimizer hands ``reduce`` its :class:`~opacus_dp.optim.reduction.StepRelease`; the noise is
added where ``draws_noise`` is true (rank 0), the sums are all-reduced, and the optimizer then
divides by ``expected_batch_size · world_size`` (mean reduction).

:class:`AllReduceReducer` puts the noise on rank 0 only: with per-rank clipped sums
``S_r`` and ``N ~ 𝒩(0, σ²C²I)`` drawn once,

    update = (N + Σ_r S_r) / (B_local · W) ,

so the averaged update carries noise of std ``σ·C / B_global`` exactly once (the same as
one process training on the union of the batches), and ``all_reduce`` hands every rank
the same bytes, so all ranks apply bit-identical updates.

Every step also checks that the ranks still agree on the settings the optimizer passes as
``agreed`` (σ, the clipping bounds, the number of batches merged into the step, ...), which a
scheduler or a branch on the rank may have changed on one rank after the setup check: rank
``r`` writes its values into row ``r`` of a ``(W, m)`` table of zeros appended to the bucket,
so the same all-reduce delivers every rank's values exactly (a sum with zeros), and a
disagreement raises the same error on every rank (no rank is left waiting in a collective).

The same rows carry a step refused by one rank's own checks (``refusal``, a code of
:mod:`~opacus_dp.optim.step_refusal`): that rank sends zero sums and the row ``[NaN, code, …]``
(NaN never is a setting), and every rank raises
:class:`~opacus_dp.optim.step_refusal.StepRefusedError` — no extra collective, no extra byte.
The all-reduce is waited for at most ``step_timeout`` (:mod:`~opacus_dp.distributed.step_wait`).
Each row also ends with the rank's step clock (:mod:`~opacus_dp.distributed.step_clock`): a rank
that skipped a batch outside the optimizer makes the step raise
:class:`~opacus_dp.distributed.step_clock.RanksOutOfStepError` on every rank (nothing applied).
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from opacus_dp.distributed.agreement import agreement_rows, check_table
from opacus_dp.distributed.checks import require_process_group
from opacus_dp.distributed.step_clock import CLOCK_COLUMNS, STEP, StepClock
from opacus_dp.distributed.step_wait import BoundedStepWait, StepTimeout
from opacus_dp.maths.huge_pages import empty_on_huge_pages
from opacus_dp.optim.reduction import StepRelease

NOISE_RANK = 0


class AllReduceReducer(BoundedStepWait):
    """Sums tensors over the processes of ``process_group`` with one all-reduce per step.

    All tensors of one (dtype, device) are flattened into a single bucket, so a model with
    one parameter dtype costs exactly one ``all_reduce`` of ``Σ_p numel(p)`` elements.
    ``bytes_reduced`` and ``num_all_reduces`` count what this rank sent into collectives.
    """

    def __init__(self, *, process_group=None, step_timeout: StepTimeout = None):
        require_process_group("AllReduceReducer")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.draws_noise = self.rank == NOISE_RANK
        self.shards = False
        self.reuses_input = not self.draws_noise  # rank 0 sends new (noised) tensors
        self.needs_equal_passes = False  # DDP's comm hook is a no-op: ranks may run more passes
        self.bytes_reduced = 0
        self.num_all_reduces = 0
        self.step_timeout = step_timeout
        self.clock = StepClock()

    @torch.no_grad()
    def reduce(self, release: StepRelease) -> List[torch.Tensor]:
        """``Σ_r S_r + N`` (the noise from rank 0), summed in place in one all-reduce per
        (dtype, device); raise on every rank if a rank refused the step or the ranks disagree on
        ``release.agreed`` (module doc); a refusal needs ``agreed`` (its rows carry it).

        Every rank must pass tensors of the same shapes in the same order (the same model).
        """
        tensors = release.bucket(noised=self.draws_noise and release.refusal is None)
        agreed, refusal = release.agreed, release.refusal
        names = sorted(agreed or {})
        if refusal is not None and not names:
            raise ValueError("AllReduceReducer.reduce: a refusal travels in the rows of agreed")
        groups = list(_grouped(tensors).values())
        rows = None
        if names and groups:
            rows = agreement_rows([agreed[n] for n in names], groups[0][0], refusal,
                                  self.world_size, self.rank, self.clock.row(STEP))
        if self.world_size == 1:
            return self._alone(tensors, names, rows)
        extra = [] if rows is None else [rows.reshape(-1)]  # the table rides in the first bucket
        flats = [_flat(same_kind + (extra if index == 0 else [])) for index, same_kind in enumerate(groups)]
        works = [dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group, async_op=True)
                 for flat in flats]
        self.bytes_reduced += sum(flat.numel() * flat.element_size() for flat in flats)
        self.num_all_reduces += len(flats)
        self._wait(works)
        self.clock.step_over()
        for same_kind, flat in zip(groups, flats):
            _unflatten(flat, same_kind)
        if rows is not None:
            table = flats[0][flats[0].numel() - rows.numel():].view_as(rows)
            check_table(names, table, clock_columns=CLOCK_COLUMNS)
        return tensors

    def _alone(self, tensors: List[torch.Tensor], names, rows) -> List[torch.Tensor]:
        """One process: the sum over the ranks is its own, and so is the settings table; nothing
        is sent (an all-reduce of one process would only copy the sums twice)."""
        self.clock.step_over()
        if rows is not None:
            check_table(names, rows, clock_columns=CLOCK_COLUMNS)
        return tensors

    @staticmethod
    def as_grad(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``value`` in ``param``'s shape and dtype (every rank holds the whole tensor)."""
        return value.view_as(param).to(param.dtype)

    def __repr__(self) -> str:
        return (
            f"AllReduceReducer(world_size={self.world_size}, rank={self.rank}, "
            f"draws_noise={self.draws_noise}, step_timeout={self.step_timeout})"
        )


def _flat(tensors: List[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated into a new flat bucket, advised to huge pages before the copy writes it
    (:mod:`~opacus_dp.maths.huge_pages`: a model-sized bucket then costs few page faults)."""
    out = empty_on_huge_pages((sum(t.numel() for t in tensors),), tensors[0].dtype, tensors[0].device)
    return torch.cat([t.reshape(-1) for t in tensors], out=out)


def all_reduces(reducer) -> bool:
    """Whether ``reducer`` is the all-reduce of this module (Opacus's ``DistributedDPOptimizer``)."""
    return isinstance(reducer, AllReduceReducer)


def _grouped(tensors: List[torch.Tensor]) -> Dict[Tuple, List[torch.Tensor]]:
    groups: Dict[Tuple, List[torch.Tensor]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"AllReduceReducer.reduce expects tensors, got {type(t).__name__}")
        groups.setdefault((t.dtype, t.device), []).append(t)
    return groups


def _unflatten(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
