"""The model checks of ``make_private`` (``check_sample_independence``, ``public_buffers``) in a
private Lightning run.

Lightning calls ``training_step``, not the model's ``forward``, so the checks sit where the batch
enters modules:

* **samples (once per module).** At the first call in training mode, with autograd on and a batch
  of ``B >= 2``, of the LightningModule's own ``forward`` (if it defines one) and of each direct
  submodule with trainable parameters, samples ``0`` and ``B - 1`` run alone must give their rows
  of the batched outputs (:func:`~opacus_dp.grad_sample.batch_independence_check.check_samples_alone`,
  batch on dimension 0 unless the module's ``batch_first`` says otherwise; buffers are restored).
  A checked module's hook is removed (no hook left to break a compiled graph). Parameter-free
  submodules (losses, metrics whose ``forward`` updates their state) are not run again. Code of
  ``training_step`` itself, between modules, is not seen, as code outside ``forward`` is not
  under ``make_private``.
* **buffers (every step).** No buffer of the LightningModule may be written between the start of a
  training batch and its backward pass (in ``training_step``, ``forward`` or a submodule), unless
  named in ``public_buffers`` (names of ``pl_module.named_buffers()``): its value would be
  released by ``state_dict()`` without noise.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from opacus_dp.grad_sample.batch_independence_check import (ModelMixesSamplesError, batch_size_of,
                                                             check_samples_alone)
from opacus_dp.grad_sample.buffer_writes import buffer_error, check_public_buffers, versions, written_buffers

LIGHTNING_FIX = ("Under DPCallback the settings are DPCallback(public_buffers=[...]) (names of "
                 "pl_module.named_buffers()) and DPCallback(check_sample_independence=False)")


def entry_modules(pl_module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` checked for mixed samples: ``("", pl_module)`` if it defines ``forward``,
    and its direct submodules with trainable parameters."""
    import lightning.pytorch as pl

    own_forward = type(pl_module).forward not in (pl.LightningModule.forward, nn.Module.forward)
    entries = [("", pl_module)] if own_forward else []
    return entries + [(name, child) for name, child in pl_module.named_children()
                      if any(p.requires_grad for p in child.parameters())]


class LightningModelChecks:
    """The checks of the module doc on ``pl_module``; ``remove()`` takes their hooks off."""

    def __init__(self, pl_module: nn.Module, *, enabled: bool, public_buffers: Sequence[str] = ()):
        if not isinstance(enabled, bool):
            raise TypeError(f"DPCallback: check_sample_independence must be a bool, got {enabled!r}")
        self.pl_module, self.enabled = pl_module, enabled
        self.public_buffers = check_public_buffers(pl_module, public_buffers)
        entries = entry_modules(pl_module) if enabled else []
        self.unchecked = {name for name, _ in entries}  # entry modules whose samples were not compared yet
        self._before: Optional[Dict[str, tuple]] = None
        self._handles = {name: module.register_forward_pre_hook(torch.compiler.disable(self._sample_check(name)),
                                                                with_kwargs=True, prepend=True)  # eager if compiled
                         for name, module in entries}

    def _sample_check(self, name: str):
        def hook(module: nn.Module, args, kwargs) -> None:
            if name not in self.unchecked or not (module.training and torch.is_grad_enabled()):
                return
            every_buffer = tuple(b for b, _ in module.named_buffers())  # buffer writes: refused per step
            try:
                check_samples_alone(module, args, kwargs, 0, every_buffer)
            except ModelMixesSamplesError as error:
                where = f"submodule {name!r}" if name else "forward"
                raise ModelMixesSamplesError(f"The LightningModule's {where}: {error}. {LIGHTNING_FIX}") from None
            if (batch_size_of(args, kwargs, 0) or 0) >= 2:
                self.unchecked.discard(name)
                self._handles.pop(name).remove()  # checked: no hook left (none to break a compiled graph)

        return hook

    def batch_starts(self) -> None:
        """Note the buffers' versions before a training batch."""
        self._before = versions(self.pl_module) if self.enabled else None

    def before_backward(self) -> None:
        """Refuse a buffer written since :meth:`batch_starts` and not declared public."""
        before, self._before = self._before, None
        if before is None:
            return
        written = written_buffers(self.pl_module, before, self.public_buffers)
        if written:
            error = buffer_error(self.pl_module, written[0])
            raise type(error)(f"{error}. {LIGHTNING_FIX}")

    def remove(self) -> None:
        for handle in self._handles.values():
            handle.remove()
        self._handles = {}
