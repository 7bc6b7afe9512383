"""The per-step agreement table of distributed DP-SGD (settings and refusals of every rank).

Rank ``r`` writes its values of the step's shared settings (σ, clipping bounds, batches merged,
...) into row ``r`` of a ``(W, m)`` table of zeros; a sum over ranks (an all-reduce, alone or
riding in a bucket of gradients) delivers every rank's row exactly. A rank that refuses the
step writes ``[NaN, code, …]`` instead (NaN never is a setting). :func:`check_table` then raises
the same error on every rank: :class:`~opacus_dp.optim.step_refusal.StepRefusedError` for a
refusal, ``ValueError`` naming the setting that differs.
"""

import math
from typing import List, Optional

import torch
import torch.distributed as dist

from opacus_dp.optim.step_refusal import OTHER, refused_elsewhere


def agreement_rows(values: List[float], like: torch.Tensor, refusal: Optional[int],
                   world_size: int, rank: int) -> torch.Tensor:
    """The ``(W, m)`` table with this rank's row filled (dtype and device of ``like``)."""
    rows = like.new_zeros(world_size, len(values))
    if refusal is not None:  # [NaN, code, code, ...]: no setting is NaN
        values = [math.nan] + [float(refusal)] * (len(values) - 1)
    rows[rank] = torch.tensor(values, dtype=torch.float64).to(like.dtype)
    return rows


def agree_alone(names: List[str], values: List[float], refusal: Optional[int], *, world_size: int,
                rank: int, device: torch.device, group=None, wait=None) -> None:
    """The table in a collective of its own (``wait(works)`` bounds it), checked on every rank."""
    rows = agreement_rows(values, torch.empty(0, dtype=torch.float64, device=device), refusal,
                          world_size, rank)
    work = dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if wait is None:
        work.wait()
    else:
        wait([work])
    check_table(names, rows)


def check_table(names: List[str], table: torch.Tensor) -> None:
    """Raise on every rank if a row is a refusal or a column (a setting) is not constant."""
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

