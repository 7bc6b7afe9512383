"""Bounded meeting points before FSDP2's own collectives (the forward and backward passes).

FSDP2 all-gathers each unit's parameters in the forward pass (and again in the backward pass
when it resharded them); those collectives wait as long as the process group does (30 minutes
by default) for a rank that stopped before them, and fail with the transport's error ("Connection
closed by peer") when a rank exited. So before the first of them every rank meets the others in
an all-reduce of its step-clock row (:mod:`~opacus_dp.distributed.step_clock`), waited for at most
``step_timeout`` (:mod:`~opacus_dp.distributed.step_wait`):

* a rank that stays away, or has exited, is named by
  :class:`~opacus_dp.distributed.step_wait.StepCollectiveError` within ``step_timeout`` plus a
  short grace, on every rank that came;
* a rank in another phase (its forward pass while the others are in their backward pass or
  step) or after another number of batches raises
  :class:`~opacus_dp.distributed.step_clock.RanksOutOfStepError` everywhere, before any unit's
  collective can pair with the wrong one.

The meeting's table has the shape of the step's agreement table (``W × (m + 2)`` float64, ``m``
the step's settings), so that it pairs with it when one rank skipped its step. Cost: one
all-reduce of ``W·(m+2)`` numbers per forward pass and one per backward pass.

Installed on the outermost ``fully_shard`` module (so it runs whichever wrapper the user calls):
a forward pre-hook placed before FSDP2's own meets in phase FORWARD; a forward hook puts a
gradient hook on the outputs that meets in phase BACKWARD when the backward pass reaches them,
before any unit's backward. Not bounded: a rank that fails *after* a meeting, in the middle of
its forward or backward pass (the others wait in FSDP2's collective for the group's timeout).
"""

import weakref
from functools import partial
from typing import List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_leaves

from opacus_dp.distributed.agreement import agreement_rows
from opacus_dp.distributed.checks import collective_device
from opacus_dp.distributed.step_clock import BACKWARD, CLOCK_COLUMNS, FORWARD, check_clock


class FsdpRendezvous:
    """The meetings of ``reducer``'s ranks (a :class:`ReduceScatterReducer`: its process group,
    bounded wait and step clock) before the forward and backward passes (module doc);
    ``settings``: the number of settings in the step's agreement table."""

    def __init__(self, reducer, settings: int):
        self.reducer = reducer
        self.settings = int(settings)
        self.meetings = 0
        self._handles: List = []

    def meet(self, phase: int) -> None:
        """One bounded all-reduce of this rank's clock row; raise on every rank if out of step."""
        r = self.reducer
        like = torch.empty(0, dtype=torch.float64, device=collective_device(r.process_group))
        rows = agreement_rows([0.0] * self.settings, like, None, r.world_size, r.rank, r.clock.row(phase))
        r._wait([dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=r.process_group, async_op=True)])
        self.meetings += 1
        check_clock(rows[:, self.settings:self.settings + CLOCK_COLUMNS])

    def install(self, root: nn.Module) -> None:
        """Hook ``root`` (the outermost ``fully_shard`` module): meet before its forward pass
        (ahead of FSDP2's own pre-forward hook) and when the backward pass reaches its outputs.
        They run eagerly where the root's call is compiled (dynamo would trace the weak reference
        into the backward hook as the object itself). The hooks hold this object weakly: once the
        optimizer (and its reducer) is gone they do nothing."""
        self.remove()
        this = weakref.ref(self)
        eager = torch.compiler.disable  # a compiled root's call runs them outside its graph
        self._handles = [root.register_forward_pre_hook(eager(partial(_before_forward, this)), prepend=True),
                         root.register_forward_hook(eager(partial(_after_forward, this)), prepend=True)]

    def remove(self) -> None:
        """Remove the hooks :meth:`install` added."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _before_forward(rendezvous: "weakref.ref[FsdpRendezvous]", module, args) -> None:
    meeting = rendezvous()
    if meeting is not None:
        meeting.meet(FORWARD)


def _after_forward(rendezvous: "weakref.ref[FsdpRendezvous]", module, args, output) -> None:
    if rendezvous() is None or not torch.is_grad_enabled():
        return
    tensors = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        register_multi_grad_hook(tensors, partial(_before_backward, rendezvous), mode="any")


def _before_backward(rendezvous: "weakref.ref[FsdpRendezvous]", grad) -> None:
    meeting = rendezvous()
    if meeting is not None:
        meeting.meet(BACKWARD)
