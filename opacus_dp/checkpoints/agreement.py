"""The ranks' agreement on a sharded checkpoint: one verdict, raised alike on every rank.

Saving or loading an FSDP2 checkpoint directory (:mod:`~opacus_dp.checkpoints.sharded`)
is collective, but most of its checks are not: rank ``r`` alone reads (or writes)
``private_rank{r}.pt``. A rank that refused alone would leave the others inside a collective of
torch's distributed checkpoint (DCP) until the process group's timeout, or report a save that
lacks its file. So each rank first runs its own checks, then writes one row
``[reason, detail, steps, digest]`` into a ``(W, 4)`` float64 table of zeros, and one all-reduce
(a sum) gives every rank every row exactly (integers below 2⁵³). :func:`agree` raises on every
rank the same :class:`ShardedCheckpointError`, built from the table alone, that names each
failing rank, its file and the reason (:class:`Refusal`, a type, not a message to parse); the
rank that failed chains its own error (``raise ... from``) with the details.

The wait is bounded by the process group's timeout, less a grace in which the waiting ranks look
for each other (:func:`~opacus_dp.distributed.step_wait.wait_for_step`); a rank that does not
join (dead, stuck, or one that skipped the call) is named as :attr:`Refusal.NO_ANSWER` (gloo).
"""

import enum
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from opacus_dp.checkpoints.file_format import CheckpointIntegrityError
from opacus_dp.checkpoints.directory import previous_path
from opacus_dp.distributed.checks import collective_device
from opacus_dp.distributed.step_wait import StepCollectiveError, absent_ranks, step_bounds, wait_for_step


class Refusal(enum.IntEnum):
    """Why a rank refuses to save or load a sharded checkpoint (never 0: 0 is "ready")."""

    NOT_A_CHECKPOINT = 1  # no ``sharded/`` directory at ``path``
    MISSING_FILE = 2      # ``private_rank{r}.pt`` is absent
    UNREADABLE = 3        # damaged, truncated, or holding objects the safe loader refuses
    SIGNATURE = 4         # the HMAC does not verify (or the file is unsigned and a key was given)
    MALFORMED = 5         # world_size, rank or dp_optimizer_steps is not a valid integer
    WORLD_SIZE = 6        # written by another number of processes (detail: that number)
    WRONG_RANK = 7        # written by another rank (detail: that rank)
    HISTORY = 8           # the privacy history does not load, or contradicts the step count
    DIFFERENT_RUNS = 9    # the ranks' files record different steps or privacy histories
    UNSAVABLE_STATE = 10  # the rank's state could not be gathered, or holds an entry the safe loader
    #                       could not read back; nothing was written
    WRITE_FAILED = 11     # the rank could not write its file
    RENAME_FAILED = 12    # rank 0 could not prepare or swap the directory into place
    NO_ANSWER = 13        # the rank did not join the agreement
    PATH_IN_USE = 14      # ``path`` is a file, or a directory holding other files; nothing was written


_INTEGRITY = (Refusal.SIGNATURE, Refusal.HISTORY)


class ShardedCheckpointError(ValueError):
    """A sharded checkpoint refused on every rank alike; ``refusals``: rank → :class:`Refusal`."""

    def __init__(self, message: str, refusals: Dict[int, Refusal]):
        super().__init__(message)
        self.refusals = dict(refusals)


class ShardedCheckpointIntegrityError(ShardedCheckpointError, CheckpointIntegrityError):
    """A :class:`ShardedCheckpointError` where a rank's file fails its signature or its privacy
    history contradicts the rest of the file."""


@dataclass(frozen=True)
class RankStatus:
    """One rank's verdict: ``reason`` None when ready; ``detail`` qualifies the reason (the world
    size or rank a file was written by); ``steps`` and ``digest`` (48 bits of SHA-256 of the
    privacy history) are compared between ranks on loading."""

    reason: Optional[Refusal] = None
    detail: int = 0
    steps: int = 0
    digest: int = 0


def rank_file_name(rank: int) -> str:
    return f"private_rank{rank}.pt"


def agree(path, status: RankStatus, *, action: str, rank: int, world_size: int, group=None,
          cause: Optional[BaseException] = None, written: bool = False) -> List[RankStatus]:
    """Every rank's :class:`RankStatus` (one bounded all-reduce); raises the same error on every
    rank if one refused (``cause``: this rank's own error, chained). ``action``: "load" or "save";
    ``written``: every rank's part of the save was written (the last agreement of a save)."""
    row = [float(status.reason or 0), float(status.detail), float(status.steps), float(status.digest)]
    table = torch.zeros(world_size, len(row), dtype=torch.float64, device=collective_device(group))
    table[rank] = torch.tensor(row, dtype=torch.float64)
    bounds = step_bounds(None, group)
    try:
        work = dist.all_reduce(table, op=dist.ReduceOp.SUM, group=group, async_op=True)
        wait_for_step([work], bounds, group)
    except (StepCollectiveError, RuntimeError) as error:  # RuntimeError: a peer's connection is gone
        missing = error.missing_ranks if isinstance(error, StepCollectiveError) else absent_ranks(group, bounds[1])
        missing = missing or []
        raise ShardedCheckpointError(_no_answer(path, action, missing, error, written),
                                     {r: Refusal.NO_ANSWER for r in missing}) from (cause or error)
    statuses = [RankStatus(Refusal(int(r[0])) if r[0] else None, int(r[1]), int(r[2]), int(r[3]))
                for r in table.tolist()]
    refusals = {r: s.reason for r, s in enumerate(statuses) if s.reason is not None}
    if not refusals and action == "load":
        refusals = _different_runs(statuses)
    if refusals:
        kind = ShardedCheckpointIntegrityError if set(refusals.values()) & set(_INTEGRITY) else ShardedCheckpointError
        raise kind(_message(path, action, statuses, refusals, world_size), refusals) from cause
    return statuses


def _different_runs(statuses: List[RankStatus]) -> Dict[int, Refusal]:
    first = statuses[0]
    if all((s.steps, s.digest) == (first.steps, first.digest) for s in statuses):
        return {}
    return {r: Refusal.DIFFERENT_RUNS for r in range(len(statuses))}


def _no_answer(path, action: str, missing: List[int], error: BaseException, written: bool) -> str:
    outcome = ("nothing was loaded" if action == "load" else
               f"{path} holds a whole checkpoint: the new one if rank 0 moved it into place, else the previous one"
               if written else "the checkpoint was not replaced (a previous one at this path is intact)")
    if not missing:
        return (f"{action} of sharded checkpoint {path}: the ranks could not agree ({error}); the backend "
                f"cannot tell which rank is missing (their logs can); {outcome}")
    names = ", ".join(str(r) for r in missing)
    return (f"{action} of sharded checkpoint {path}: rank{'s' if len(missing) > 1 else ''} {names} did not "
            f"answer (dead, stuck, or not calling {action}_checkpoint); {outcome}. Call it on every rank; "
            "this process group cannot be used any more: restart every rank")


def _message(path, action: str, statuses: List[RankStatus], refusals: Dict[int, Refusal], world_size: int) -> str:
    lines = [_describe(path, r, reason, statuses, world_size) for r, reason in sorted(refusals.items())]
    if Refusal.DIFFERENT_RUNS in refusals.values():
        lines = [lines[0]]  # one line says it for every rank
    outcome = ("nothing was loaded on any rank" if action == "load" else
               "no rank saved it; a previous checkpoint at this path is intact")
    return f"sharded checkpoint {path} refused on every rank ({outcome}): " + "; ".join(lines)


def _describe(path, rank: int, reason: Refusal, statuses: List[RankStatus], world_size: int) -> str:
    file = os.path.join(os.fspath(path), rank_file_name(rank))
    detail = statuses[rank].detail
    see = f" (rank {rank}'s own error says why)"
    previous = previous_path(path)
    aside = (f" (an interrupted save left the previous checkpoint at {previous}: the next save_checkpoint "
             f"to {path} puts it back, or rename it yourself)" if os.path.isdir(previous) else "")
    texts = {
        Refusal.NOT_A_CHECKPOINT: f"rank {rank} finds no sharded checkpoint directory at {path} "
                                  f"(save_checkpoint of an FSDP2 model writes one){aside}",
        Refusal.MISSING_FILE: f"rank {rank}'s file {file} is missing (copy the whole directory; a run of "
                              "fewer processes writes fewer rank files)",
        Refusal.UNREADABLE: f"rank {rank}'s file {file} is damaged or not a safe checkpoint file{see}",
        Refusal.SIGNATURE: f"rank {rank}'s file {file} fails its signature check (changed after it was "
                           "written, unsigned, or signed with another key)",
        Refusal.MALFORMED: f"rank {rank}'s file {file} has malformed integrity fields (world_size, rank and "
                           "dp_optimizer_steps must be integers in range)",
        Refusal.WORLD_SIZE: f"rank {rank}'s file {file} was written by a run of {detail} processes, not the "
                            f"{world_size} running now: resume with {detail} processes",
        Refusal.WRONG_RANK: f"rank {rank}'s file {file} was written by rank {detail} (the rank files were "
                            "renamed or swapped: give each rank back its own file)",
        Refusal.HISTORY: f"rank {rank}'s file {file} holds a privacy history this accountant does not load "
                         f"or that contradicts its step count{see}",
        Refusal.DIFFERENT_RUNS: "the rank files come from different saves: they record "
                                + ", ".join(f"{s.steps} steps (rank {r})" for r, s in enumerate(statuses))
                                + " and privacy histories that differ; use one save's files together",
        Refusal.UNSAVABLE_STATE: f"rank {rank} could not gather its state, or holds an entry the safe loader "
                                 f"could not read back{see}",
        Refusal.WRITE_FAILED: f"rank {rank} could not write its file {file}{see}",
        Refusal.PATH_IN_USE: f"{path} is a file or holds files a sharded checkpoint did not write, which "
                             "saving would delete (a save replaces the whole directory): save into a "
                             "directory of its own",
        Refusal.RENAME_FAILED: f"rank 0 could not prepare or move the directory into place{see}{aside}",
    }
    return texts.get(reason, f"rank {rank}: {reason.name}")
