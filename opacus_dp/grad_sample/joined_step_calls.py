"""A recurrent layer's step projection recorded as one call per run of a sequence.

``DPLSTM`` and ``DPRNN`` compute ``z_t = ih(x)_t + W_hh h_{t-1} + b_hh`` at each step ``t``, with
one call of ``ih`` over the whole sequence and one call of ``hh`` per step. Hooked per step, each of
the ``T`` calls of ``hh`` pays the hooks' bookkeeping (recording the call in the forward pass, its
output gradient in the backward pass), and in ``hooks`` each materialises ``B`` per-sample gradients.

For a run over a sequence the wrapper can take ``hh``'s steps over
(:mod:`~opacus_dp.layers.joined_steps`): the steps compute ``W_hh h_{t-1} + b_hh`` unhooked, from
``hh``'s parameters detached where the wrapper switches autograd's weight gradients off (``ghost``,
``bk``) and from the parameters themselves otherwise (``hooks``: autograd forms ``hh``'s ordinary
gradient, as the module's calls did), and the wrapper records **one**
call of ``hh`` whose input is ``H = (h_{t-1})_t`` stacked ``(B, T, H)`` and whose output gradient
is the gradient ``G (B, T, p)`` of ``ih``'s output. ``G_t = ∂L/∂z_t`` is the gradient of ``hh``'s
output at step ``t`` too, since both outputs enter the step only through the sum ``z_t``, so the
call's per-sample gradient ``Σ_t G_{i,t} h_{i,t-1}ᵀ`` is the sum of the per-step calls' (in another
order of summation). ``G`` is the very tensor ``ih``'s call receives: in the norms-only modes the
bookkeeper resolves the two calls together and forms ``G``'s Gram products once
(:meth:`~opacus_dp.grad_sample.bookkeeping.bookkeeper.Bookkeeper.record`).

In a compiled forward (:mod:`~opacus_dp.grad_sample.traced_taps`) the graph computes the steps
the same way and gives the stacked inputs out with the tapped calls; the joined call's output
gradient is the gradient of ``ih``'s tap, which stands for ``ih``'s output (``y + t``). That needs
``ih``'s call tapped just before the steps and no hook of another on ``ih`` either (one could
change ``ih``'s output after the tap); the decision is made before each compiled forward
(:meth:`JoinedStepCalls.plan_traced`), and the forward that learns the taps' layout calls ``hh``.

The steps call ``hh`` as before (hooked per step) wherever that is not certain to be equivalent:
without grad or while the hooks are disabled, in the forward that learns the taps' layout,
during a backward pass (a checkpoint's recomputation), when ``ih``'s output does not require
grad, when the cell's recurrence is not ``DPLSTMCell``'s or ``DPRNNCell``'s own (a subclass that
changes it inherits the declared pair, but perhaps not the sum ``z_t``), when ``hh`` is not a
plain ``RNNLinear`` (a subclass, a replaced ``forward``, a parametrization), carries hooks other
than the wrapper's own or none of its parameters is trainable, when global module hooks other
than the engine's are registered, and when the model is sharded (FSDP2) or the wrapper
recomputes every layer with ``torch.func`` (``functorch``).
"""

import weakref
from typing import Dict, Optional, Set

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from opacus_dp.distributed.data_parallel import own_global_hook_ids
from opacus_dp.layers.batch_first import BatchFirstLinear
from opacus_dp.layers.joined_steps import JoinedSteps, mark_traced, register
from opacus_dp.layers.rnn_cells import DPLSTMCell, DPRNNCell, DPRNNCellBase
from opacus_dp.module_parameters import has_trainable_parameters, own_parameters
from opacus_dp.torch_internals import current_graph_task_id, global_module_hook_ids


# the steps whose z_t = ih(x)_t + hh(h_{t-1}) is known to feed hh's output into nothing else: a
# subclass's own recurrence (which inherits the declared pair) keeps the checked per-step calls
JOINABLE_RECURRENCES = (DPLSTMCell.recurrence, DPRNNCell.recurrence)


def _joinable(cell: nn.Module) -> bool:
    return (type(cell).recurrence in JOINABLE_RECURRENCES and "recurrence" not in vars(cell)
            and ("ih", "hh") in getattr(cell, "_dp_shared_gate_gradients", ())
            and isinstance(getattr(cell, "hh", None), BatchFirstLinear))


def joinable_cells(model: nn.Module):
    """``(path, cell)`` of the cells whose step projection shares ``ih``'s output gradient."""
    for path, cell in model.named_modules():
        if isinstance(cell, DPRNNCellBase) and _joinable(cell):
            yield path, cell


def own_hook_ids(handles, layer: nn.Module) -> Set[int]:
    """The ids of the forward hooks among ``handles`` (a wrapper's) that sit on ``layer``."""
    tables = (id(layer._forward_pre_hooks), id(layer._forward_hooks))
    return {h.id for h in handles if isinstance(h, RemovableHandle) and id(h.hooks_dict_ref()) in tables}


class JoinedStepCalls:
    """The recorder of one cell (:func:`~opacus_dp.layers.joined_steps.register`); holds the
    wrapper weakly. ``hook_ids``: the wrapper's own hooks on ``cell.ih`` and on ``cell.hh``, by layer."""

    def __init__(self, wrapper, path: str, cell: nn.Module, hook_ids: Dict[nn.Module, Set[int]]):
        self._wrapper, self._cell = weakref.ref(wrapper), weakref.ref(cell)
        self._path = f"{path}.hh" if path else "hh"
        self._ih_path = f"{path}.ih" if path else "ih"
        self._hooked = {name: (weakref.ref(getattr(cell, name)), hook_ids[getattr(cell, name)]) for name in ("ih", "hh")}

    def install(self):
        """Register for the cell; returns the handle (``remove()``)."""
        return register(self._cell(), self)

    def __call__(self, cell: nn.Module, gates: torch.Tensor, steps: int) -> Optional[JoinedSteps]:
        if cell is not self._cell():  # a copy of the cell
            return None
        if torch.compiler.is_compiling():
            return self._traced(gates, steps)  # the cell was marked for this forward (plan_traced)
        mark_traced(cell, None)  # left by an interrupted compiled forward
        wrapper = self._wrapper()
        if wrapper is None or not gates.requires_grad or wrapper._taps.learning \
                or current_graph_task_id() != -1 or not self._static(wrapper, cell):
            return None
        hh = cell.hh
        if wrapper.skips_weight_grads:
            for _, param in own_parameters(hh):
                wrapper._outside_use.watch(param)  # as the weight-gradient switch does at a call
        return self._steps(hh, steps, wrapper.skips_weight_grads,
                           lambda inputs, out: wrapper._record_joined_steps(self._path, hh, inputs, out))

    def plan_traced(self, wrapper) -> None:
        """Before a tapped forward (eagerly): whether its graph joins this cell's steps (the cell
        marked for it, :func:`~opacus_dp.layers.joined_steps.mark_traced`)."""
        cell = self._cell()
        if cell is not None:
            joining = self._static(wrapper, cell) and self._only_own_hooks(cell, "ih")
            mark_traced(cell, self if joining else None)

    def end_traced(self) -> None:
        """After a tapped forward: the cell's mark removed."""
        cell = self._cell()
        if cell is not None:
            mark_traced(cell, None)

    def _traced(self, gates: torch.Tensor, steps: int) -> Optional[JoinedSteps]:
        """The steps in a tapped forward's graph, if ``ih``'s call just took its tap."""
        wrapper, cell = self._wrapper(), self._cell()
        taps = wrapper._taps
        tap = taps.last_tap(self._ih_path)
        if tap is None or not gates.requires_grad:
            return None
        return self._steps(cell.hh, steps, wrapper.skips_weight_grads,
                           lambda inputs, out: taps.add_joined(self._path, inputs, tap))

    @staticmethod
    def _steps(hh: nn.Module, steps: int, detached: bool, finish) -> JoinedSteps:
        """The run's steps, from ``hh``'s parameters (``detached``: where the wrapper switches
        autograd's weight gradients off; otherwise autograd forms ``hh``'s ordinary gradient)."""
        weight, bias = hh.weight, hh.bias
        if detached:
            weight, bias = weight.detach(), None if bias is None else bias.detach()
        return JoinedSteps(weight, bias, steps, finish)

    def _only_own_hooks(self, cell: nn.Module, name: str) -> bool:
        """Whether ``cell.<name>`` is the layer the wrapper hooked and carries no other hooks."""
        layer, (hooked, own) = getattr(cell, name), self._hooked[name]
        return (layer is hooked() and set(layer._forward_pre_hooks) | set(layer._forward_hooks) <= own
                and not layer._backward_hooks and not layer._backward_pre_hooks)

    def _static(self, wrapper, cell: nn.Module) -> bool:
        """The conditions that do not depend on the run's tensors (module doc)."""
        hh = cell.hh
        return (torch.is_grad_enabled() and wrapper._recording()
                and _joinable(cell) and type(hh) is BatchFirstLinear and "forward" not in vars(hh)
                and has_trainable_parameters(hh) and self._only_own_hooks(cell, "hh")
                and global_module_hook_ids() <= own_global_hook_ids())
