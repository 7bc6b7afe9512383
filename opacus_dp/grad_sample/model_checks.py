"""Hooks on a wrapped model that run its model-level checks on recorded forward passes.

* before the model's first recorded forward in training mode with ``B >= 2`` samples: samples run
  alone give their rows of the batched outputs (:mod:`~opacus_dp.grad_sample.batch_independence_check`);
* around every recorded forward: no buffer is written unless declared public
  (:mod:`~opacus_dp.grad_sample.buffer_writes`).

The hooks sit on the model under any ``DistributedDataParallel``/DPDDP wrapper: torch's DDP
broadcasts buffers in its own forward, which is not a write of the model's, and its forward runs
collectives the check must not repeat. A model sharded with FSDP2 gets the buffer check only.
"""

from typing import Callable, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from opacus_dp.distributed.dpddp import DifferentiallyPrivateDistributedDataParallel
from opacus_dp.grad_sample.batch_independence_check import batch_size_of, check_samples_alone
from opacus_dp.grad_sample.buffer_writes import buffer_error, check_public_buffers, versions, written_buffers
from opacus_dp.grad_sample.compiled_modules import EagerAroundCompiledCall, run_hooks_eagerly
from opacus_dp.module_parameters import is_sharded_model


def _inner(model: nn.Module) -> nn.Module:
    """The module under ``DistributedDataParallel`` wrappers (their forward runs collectives)."""
    while isinstance(model, (DistributedDataParallel, DifferentiallyPrivateDistributedDataParallel)):
        model = model.module
    return model


class ModelChecks(EagerAroundCompiledCall):
    """Hooks on the wrapped model running the checks of the module doc on recorded forwards.

    Args:
        batch_first: the wrapper's layout (batch on dimension 0, else 1).
        recording: whether the wrapper records now (hooks enabled); held weakly by the caller.
        enabled: False turns both checks off.
        public_buffers: names of buffers (``model.named_buffers()``) that may be written.
    """

    def __init__(self, batch_first: bool, recording: Callable[[], bool], enabled: bool = True,
                 public_buffers: Sequence[str] = ()):
        if not isinstance(enabled, bool):
            raise TypeError(f"check_sample_independence must be a bool, got {enabled!r}")
        self.batch_dim = 0 if batch_first else 1
        self.enabled, self.public_buffers = enabled, public_buffers
        self.samples_checked = False
        self._recording, self._running, self._before = recording, False, None
        self._sharded = False

    def attach(self, model: nn.Module) -> list:
        """Validate ``public_buffers`` and hook the model under any DDP wrapper (its handles)."""
        inner = _inner(model)
        self.public_buffers = check_public_buffers(inner, self.public_buffers)
        self._sharded = is_sharded_model(model)
        if not self.enabled:
            return []
        return [inner.register_forward_pre_hook(self.unless_around(self._starts), with_kwargs=True, prepend=True),
                inner.register_forward_hook(self.unless_around(self._ends))]

    def around(self, model: nn.Module, call: Callable, args, kwargs):
        """``call(*args, **kwargs)``, the wrapped ``model``'s compiled call, with the checks run
        eagerly before and after it."""
        inner = _inner(model)
        self._starts(inner, args, kwargs)
        with self.compiled_call():
            output = call(*args, **kwargs)
        self._ends(inner, args, output)
        return output

    def _active(self) -> bool:
        return self.enabled and not self._running and torch.is_grad_enabled() and self._recording()

    def _starts(self, model: nn.Module, args, kwargs) -> None:
        self._before = None
        if not self._active():
            return
        if model.training and not self.samples_checked and not self._sharded:
            self._running = True
            try:
                check_samples_alone(model, args, kwargs, self.batch_dim, self.public_buffers)
            finally:
                self._running = False
            self.samples_checked = (batch_size_of(args, kwargs, self.batch_dim) or 0) >= 2
        self._before = versions(model)

    def _ends(self, model: nn.Module, args, output) -> None:
        before, self._before = self._before, None
        if before is None:
            return
        written = written_buffers(model, before, self.public_buffers)
        if written:
            raise buffer_error(model, written[0])


def replace_model_checks(old: Optional[ModelChecks], model: nn.Module, handles: List, batch_first: bool,
                         recording: Callable[[], bool], enabled: bool, public_buffers: Sequence[str]) -> ModelChecks:
    """New :class:`ModelChecks` on ``model`` in place of ``old``; ``handles`` (the wrapper's list,
    changed in place) loses the old hooks and gains the new ones (run eagerly under ``torch.compile``)."""
    checks = ModelChecks(batch_first, recording, enabled, public_buffers)
    checks.handles = checks.attach(model)
    run_hooks_eagerly(model, checks.handles, {handle.id: checks.unless_around for handle in checks.handles})
    for handle in getattr(old, "handles", []):
        handle.remove()
        if handle in handles:
            handles.remove(handle)
    handles.extend(checks.handles)
    return checks
