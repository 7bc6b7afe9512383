"""Where a per-sample-gradient wrapper may record a recurrent layer's step projection as one call.

:class:`~opacus_dp.layers.dp_rnn.DPRNNBase` runs its recurrent projection ``hh`` once per step,
``z_t = ih(x)_t + W_hh h_{t-1} + b_hh``. Before a run over a sequence it asks
:func:`joined_steps` whether a wrapper registered for the cell (:func:`register`) takes over those
calls for this run: if it does, the steps compute ``W_hh h_{t-1} + b_hh`` with the
:class:`JoinedSteps`' tensors (not calling the module), keep each step's input ``h_{t-1}``, and
hand them over stacked, ``(B, T, H)``, with ``ih``'s output at the end of the run
(:meth:`JoinedSteps.finish`). Otherwise (None, the usual case) the steps call ``hh``.

The layers never import the wrappers: this module is the whole interface between them.
"""

import weakref
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, Callable]" = weakref.WeakKeyDictionary()
_TRACED = "_dp_traced_joined_steps"  # mark_traced


class JoinedSteps:
    """One run's steps: :meth:`project` replaces ``hh``'s call; :meth:`keep` copies step ``t``'s
    input ``h_{t-1}`` into one ``(B, T, H)`` tensor (a copy: the recorded call holds no step's own
    state); ``finish(H, gates)`` is the recorder's.

    Eagerly each step is written into its slice of ``H`` at once. In a compiled forward the steps'
    inputs are stacked after the last step instead: ``T`` writes into slices of one tensor become
    a chain of ``T`` scatters there, which the compiler fused into one kernel that reads every
    step's input for every entry of ``H`` (``T²`` work), while a stack compiles to each step
    writing its own slice."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], steps: int,
                 finish: Callable[[torch.Tensor, torch.Tensor], None]):
        self.weight, self.bias, self.steps = weight, bias, steps
        self.inputs: Optional[torch.Tensor] = None
        self._traced_inputs: List[Optional[torch.Tensor]] = []  # by step (a reverse run keeps T-1 first)
        self._finish = finish

    def project(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight, self.bias)

    def keep(self, t: int, h: torch.Tensor) -> None:
        """Step ``t``'s input (before the step runs)."""
        if torch.compiler.is_compiling():
            if not self._traced_inputs:
                self._traced_inputs = [None] * self.steps
            self._traced_inputs[t] = h.detach()
            return
        if self.inputs is None:
            self.inputs = h.new_empty(h.shape[0], self.steps, h.shape[1])
        self.inputs[:, t] = h.detach()

    def finish(self, gates: torch.Tensor) -> None:
        """After the last step: ``gates`` is ``ih``'s output that the steps added into ``z_t``."""
        if self._traced_inputs:
            self.inputs, self._traced_inputs = torch.stack(self._traced_inputs, dim=1), []
        self._finish(self.inputs, gates)


class _Registration:
    """Handle of :func:`register` (``remove()``, as a hook handle)."""

    def __init__(self, cell: nn.Module, recorder: Callable):
        self._cell, self._recorder = weakref.ref(cell), recorder

    def remove(self) -> None:
        cell = self._cell()
        if cell is not None and _RECORDERS.get(cell) is self._recorder:
            del _RECORDERS[cell]
            mark_traced(cell, None)


def register(cell: nn.Module, recorder: Callable[[nn.Module, torch.Tensor, int], Optional[JoinedSteps]]) -> _Registration:
    """``recorder(cell, gates, steps)`` is asked before each run of ``cell`` over a sequence (a
    copy of the cell made while it was marked passes itself: the recorder answers None)."""
    _RECORDERS[cell] = recorder
    return _Registration(cell, recorder)


def mark_traced(cell: nn.Module, recorder: Optional[Callable]) -> None:
    """The recorder asked in the compiled forward about to run (None: none). A traced forward
    reads it from the cell itself, an attribute present only while that forward runs: the
    compiler guards on what a traced function reads, and a process-wide table changes whenever
    any model's wrapper comes or goes."""
    if recorder is None:
        cell.__dict__.pop(_TRACED, None)
    else:
        cell.__dict__[_TRACED] = recorder


def joined_steps(cell: nn.Module, gates: torch.Tensor) -> Optional[JoinedSteps]:
    """The run's :class:`JoinedSteps` if a wrapper takes over ``cell.hh``'s steps, else None;
    ``gates``: ``ih``'s output for the run, ``(B, T, num_gates * hidden)``."""
    if gates.dim() != 3 or gates.shape[1] == 0:
        return None
    recorder = getattr(cell, _TRACED, None) if torch.compiler.is_compiling() else _RECORDERS.get(cell)
    return None if recorder is None else recorder(cell, gates, gates.shape[1])
