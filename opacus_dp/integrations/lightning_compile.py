"""Traced taps for a module Lightning compiles (``trainer.fit(torch.compile(module))``).

Lightning compiles the ``LightningModule``'s ``training_step``
(``lightning.pytorch.utilities.compile.from_compiled``), which calls the model's layers itself:
the private wrapper's forward, which makes the taps that keep the hooked layers inside the
compiled graphs (``docs/compile.md``), never runs, and each hooked layer would be a graph break.
:class:`CompiledStepTaps` does around each training step what that forward does around the
model's compiled call (:func:`~opacus_dp.grad_sample.traced_forward.begin_outside_forward`), the
batch standing for the inputs:

* before ``training_step`` (``on_train_batch_start``): the taps of the batch's signature (its
  tensors' shapes but the batch size, dtypes, devices; not its other values, such as strings);
  for a signature not learned yet, the step runs eagerly
  (``torch.compiler.set_stance("force_eager")``) and its hooked calls are learned;
* after it (``on_before_backward``; ``on_train_batch_end``, ``on_exception`` or ``teardown``
  when no backward pass follows): the tapped calls are recorded as the hooks record them
  eagerly, and the compiler's stance is given back.

A signature whose calls cannot be tapped keeps the hooks outside the graphs, as does a torch
without ``torch.compiler.set_stance`` (before 2.6).
"""

from typing import Optional

import torch
from torch.utils._pytree import tree_flatten

from opacus_dp.grad_sample.traced_forward import begin_outside_forward, end_outside_forward
from opacus_dp.grad_sample.traced_taps import LEARN


class CompiledStepTaps:
    """The taps of one private wrapper around the training steps of a compiled ``pl_module``
    (module doc); does nothing for a module Lightning does not compile."""

    def __init__(self, wrapper, pl_module):
        compiled = getattr(pl_module, "_compiler_ctx", None) is not None
        tappable = hasattr(wrapper, "_taps") and hasattr(torch.compiler, "set_stance")
        self._wrapper = wrapper if compiled and tappable else None
        self._open: Optional[tuple] = None  # (plan, args, the eager stance or None) of the running step

    def before_step(self, batch) -> None:
        if self._wrapper is None:
            return
        self.after_step(completed=False)  # a step left open (no backward pass followed)
        args = tuple(leaf for leaf in tree_flatten(batch)[0] if isinstance(leaf, torch.Tensor))
        plan = begin_outside_forward(self._wrapper, args, {})
        stance = torch.compiler.set_stance("force_eager") if plan == LEARN else None
        self._open = (plan, args, stance)

    def after_step(self, completed: bool = True) -> None:
        if self._open is None:
            return
        plan, args, stance = self._open
        self._open = None
        if stance is not None:
            stance.__exit__(None, None, None)  # the stance before the step
        end_outside_forward(self._wrapper, plan, args, {}, completed)
