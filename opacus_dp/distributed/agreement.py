"""The per-step agreement table of distributed DP-SGD (settings and refusals of every rank).

Rank ``r`` writes its values of the step's shared settings (σ, clipping bounds, batches merged,
...) into row ``r`` of a ``(W, m)`` table of zeros; a sum over ranks (an all-reduce, alone or
riding in a bucket of gradients) delivers every rank's row exactly. A rank that refuses the
step writes ``[NaN, code, …]`` instead (NaN never is a setting). :func:`check_table` then raises
the same error on every rank: :class:`~opacus_dp.optim.step_refusal.StepRefusedError` for a
refusal, ``ValueError`` naming the setting that differs.

With a ``clock`` the row ends with the rank's ``[phase, batches since its last step]``
(:mod:`~opacus_dp.distributed.step_clock`), checked first: ranks out of step raise
:class:`~opacus_dp.distributed.step_clock.RanksOutOfStepError` everywhere. A refusing rank keeps
its clock columns.
"""

import math
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from opacus_dp.distributed.step_clock import check_clock
from opacus_dp.optim.step_refusal import OTHER, refused_elsewhere


def agreement_rows(values: List[float], like: torch.Tensor, refusal: Optional[int],
                   world_size: int, rank: int, clock: Sequence[float] = ()) -> torch.Tensor:
    """The ``(W, m + len(clock))`` table with this rank's row filled (dtype and device of ``like``)."""
    rows = like.new_zeros(world_size, len(values) + len(clock))
    if refusal is not None:  # [NaN, code, code, ...]: no setting is NaN
        values = [math.nan] + [float(refusal)] * (len(values) - 1)
    rows[rank] = torch.tensor(list(values) + list(clock), dtype=torch.float64).to(like.dtype)
    return rows


def agree_alone(names: List[str], values: List[float], refusal: Optional[int], *, world_size: int,
                rank: int, device: torch.device, group=None, wait=None, clock: Sequence[float] = (),
                after_wait: Optional[Callable[[], None]] = None) -> None:
    """The table in a collective of its own (``wait(works)`` bounds it), checked on every rank;
    ``after_wait`` runs once the collective completed, before the checks."""
    rows = agreement_rows(values, torch.empty(0, dtype=torch.float64, device=device), refusal,
                          world_size, rank, clock)
    work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if wait is None:
        work.wait()
    else:
        wait([work])
    if after_wait is not None:
        after_wait()
    check_table(names, rows, clock_columns=len(clock))


def check_table(names: List[str], table: torch.Tensor, clock_columns: int = 0) -> None:
    """Raise on every rank if the clock columns (the last ``clock_columns``) differ, a row is a
    refusal or a column (a setting) is not constant."""
    if clock_columns:
        check_clock(table[:, table.shape[1] - clock_columns:])
        table = table[:, :table.shape[1] - clock_columns]
    _check_refusals(table)
    _check_agreement(names, table)


def _check_refusals(table: torch.Tensor) -> None:
    """Raise :class:`StepRefusedError` if a row of ``table`` is a refusal (``[NaN, code, …]``)."""
    refused = torch.isnan(table[:, 0])
    if bool(refused.any()):
        codes = table[:, 1] if table.shape[1] > 1 else torch.full_like(table[:, 0], OTHER)
        raise refused_elsewhere({int(r): int(codes[r]) for r in refused.nonzero().flatten().tolist()})


def _check_agreement(names: List[str], table: torch.Tensor) -> None:
    """Raise if a column of ``table`` (one row per rank) is not constant."""
    for column, name in enumerate(names):
        values = table[:, column]
        if not bool((values == values[0]).all()):
            per_rank = {rank: float(v) for rank, v in enumerate(values.tolist())}
            raise ValueError(
                f"{name} differs between ranks at this step ({per_rank}): every process must use "
                "the same settings (step schedulers on every rank, not only on rank 0; run the same "
                "number of backward passes per step everywhere). Nothing was updated")

