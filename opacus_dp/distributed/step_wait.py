"""A bounded wait for the all-reduce of a private step, and the ranks that did not join it.

A rank that fails but stays alive (it caught an exception before ``optimizer.step()``, or is
stuck) would hold the others in the step's all-reduce until the process group's timeout (30
minutes by default for gloo). The reducer starts its all-reduce asynchronously and waits at
most ``step_timeout`` (the group's own timeout by default). Only when that wait fails does
:func:`absent_ranks` find out who is missing: every waiting rank sends a token to every other
and waits a short grace for theirs; the ranks whose token does not come did not reach the step.
The normal step pays nothing for this. Gloo only (a point-to-point exchange with an absent
peer could block on other backends: there the error cannot name the ranks). Under FSDP2 the
same bounded wait guards the meeting before every forward and backward pass
(:mod:`~opacus_dp.distributed.fsdp_rendezvous`).
"""

import datetime
import math
import time
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from opacus_dp.distributed.checks import collective_device

MIN_GRACE_S, MAX_GRACE_S = 1.0, 10.0  # how long the waiting ranks look for each other's tokens
_TOKEN_TAG = 0x0D95  # tag of the tokens, apart from any user's point-to-point messages

StepTimeout = Union[None, int, float, datetime.timedelta]


class StepCollectiveError(RuntimeError):
    """The all-reduce of a private step did not complete; ``missing_ranks``: the ranks (of the
    process group) that did not join it, or None where the backend cannot tell."""

    def __init__(self, message: str, missing_ranks: Optional[List[int]]):
        super().__init__(message)
        self.missing_ranks = missing_ranks


def timeout_seconds(value: StepTimeout, name: str = "step_timeout") -> Optional[float]:
    """``value`` (seconds or a timedelta) as seconds > 0; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{name} must be a number of seconds or a datetime.timedelta, got {type(value).__name__}")
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a finite time > 0, got {value!r}")
    return seconds


def group_timeout_seconds(group=None) -> Optional[float]:
    """The process group's own collective timeout, None where torch does not expose it."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        return pg._get_backend(collective_device(group)).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def step_bounds(step_timeout: Optional[float], group=None) -> Tuple[Optional[float], float]:
    """``(wait, grace)`` in seconds: how long to wait for the step's all-reduce (None: as long
    as the group does), then for the other ranks' tokens. Both end before the group's own
    timeout, which would close the connections the tokens need."""
    group_s = group_timeout_seconds(group)
    wait = min(t for t in (step_timeout, group_s, math.inf) if t is not None)
    if math.isinf(wait):
        return None, MIN_GRACE_S
    grace = min(MAX_GRACE_S, max(MIN_GRACE_S, wait / 10))
    if group_s is not None and group_s > 2 * grace:
        wait = min(wait, group_s - 2 * grace)
    return wait, grace


def wait_for_step(works: Sequence, bounds: Tuple[Optional[float], float], group=None) -> None:
    """Wait for the all-reduce ``works`` of a step within ``bounds`` (:func:`step_bounds`);
    raise :class:`StepCollectiveError` naming the missing ranks if they do not complete."""
    wait, grace = bounds
    deadline = None if wait is None else time.monotonic() + wait
    try:
        for work in works:
            if deadline is None:
                work.wait()
            elif not work.wait(timeout=_remaining(deadline)):
                raise RuntimeError("timed out")
    except RuntimeError as error:  # torch's DistBackendError is one too
        missing = absent_ranks(group, grace) if wait is not None else None
        raise StepCollectiveError(_message(error, missing, wait, grace), missing) from error


def absent_ranks(group, grace: float) -> Optional[List[int]]:
    """The ranks of ``group`` that send no token within ``grace`` seconds (module doc);
    None if the backend is not gloo."""
    if dist.get_backend(group) != "gloo":
        return None
    me, world = dist.get_rank(group), dist.get_world_size(group)
    token, absent, pending = torch.zeros(1), set(), {}
    for rank in (r for r in range(world) if r != me):
        peer = rank if group is None else dist.get_global_rank(group, rank)
        try:
            pending[rank] = (dist.isend(token, dst=peer, group=group, tag=_TOKEN_TAG),
                             dist.irecv(torch.zeros(1), src=peer, group=group, tag=_TOKEN_TAG))
        except RuntimeError:  # the connection is gone: the peer died
            absent.add(rank)
    deadline = time.monotonic() + grace
    for rank, (_, received) in pending.items():
        try:
            if not received.wait(timeout=_remaining(deadline)):
                absent.add(rank)
        except RuntimeError:
            absent.add(rank)
    return sorted(absent)


def _remaining(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))


def _message(error: Exception, missing: Optional[List[int]], wait: Optional[float], grace: float) -> str:
    advice = (
        " Such a rank probably caught an exception (before its forward pass, backward pass or "
        "optimizer.step()) and went on, or is stuck or dead. This process group can no longer be "
        "used: destroy it and restart every rank (e.g. torchrun --max-restarts=...), resuming "
        "from the last checkpoint; if the ranks "
        "are only slow, raise step_timeout (make_private(step_timeout=...) or DPDDP(..., "
        "step_timeout=...)). Nothing of this step was applied on this rank")
    within = "" if wait is None else f" (waited up to {wait:g} s)"
    if missing:
        names = ", ".join(str(r) for r in missing)
        return (f"the all-reduce of this private step (at optimizer.step(), or before an FSDP2 "
                f"forward or backward pass) did not complete{within}: "
                f"rank{'s' if len(missing) > 1 else ''} {names} did not join it (no answer in a "
                f"further {grace:g} s).{advice}")
    if missing is None:
        return (f"the all-reduce of this private step did not complete{within} ({error}); the "
                f"backend cannot tell which ranks did not join it (their logs can).{advice}")
    return (f"the all-reduce of this private step failed ({error}) although every rank answered "
            "afterwards: check that every rank steps the same model.")


class BoundedStepWait:
    """For a reducer with a ``process_group``: the settable ``step_timeout`` (seconds or timedelta;
    None: the process group's timeout) and ``_wait(works)``, which waits at most that long."""

    def close(self) -> None:
        """Remove what the reducer attached to the model (nothing, unless overridden)."""

    @property
    def step_timeout(self) -> Optional[float]:
        """Seconds a step waits for the other ranks (None: the process group's timeout)."""
        return self._step_timeout

    @step_timeout.setter
    def step_timeout(self, value: StepTimeout) -> None:
        self._step_timeout = timeout_seconds(value)
        self._bounds = step_bounds(self._step_timeout, self.process_group)

    def _wait(self, works) -> None:
        wait_for_step(works, self._bounds, self.process_group)
