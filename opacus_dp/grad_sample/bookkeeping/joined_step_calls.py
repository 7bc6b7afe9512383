"""A recurrent layer's step projection recorded as one call per run of a sequence (``ghost``, ``bk``).

``DPLSTM`` and ``DPRNN`` compute ``z_t = ih(x)_t + W_hh h_{t-1} + b_hh`` at each step ``t``, with
one call of ``ih`` over the whole sequence and one call of ``hh`` per step. Hooked per step, each of
the ``T`` calls of ``hh`` pays the hooks' bookkeeping (recording the call in the forward pass, its
output gradient in the backward pass), which on a short step is a large part of the step's time.

In the norms-only modes autograd's weight gradients are switched off anyway, so for a run over a
sequence the wrapper can take ``hh``'s steps over (:mod:`~opacus_dp.layers.joined_steps`): the steps
compute ``W_hh h_{t-1} + b_hh`` from detached parameters, unhooked, and the wrapper records **one**
call of ``hh`` whose input is ``H = (h_{t-1})_t`` stacked ``(B, T, H)`` and whose output gradient
is the gradient ``G (B, T, p)`` of ``ih``'s output. ``G_t = ∂L/∂z_t`` is the gradient of ``hh``'s
output at step ``t`` too, since both outputs enter the step only through the sum ``z_t``, so the
call's per-sample gradient ``Σ_t G_{i,t} h_{i,t-1}ᵀ`` is the sum of the per-step calls' (in another
order of summation). ``G`` is the very tensor ``ih``'s call receives: the bookkeeper resolves the two
calls together and forms ``G``'s Gram products once
(:meth:`~opacus_dp.grad_sample.bookkeeping.bookkeeper.Bookkeeper.record`).

The steps call ``hh`` as before (hooked per step) wherever that is not certain to be equivalent:
without grad or while the hooks are disabled, inside a traced (compiled) forward or one that
learns the taps' layout, during a backward pass (a checkpoint's recomputation), when ``ih``'s
output does not require grad, when ``hh`` is not a plain ``RNNLinear`` (a subclass, a replaced
``forward``, a parametrization), carries hooks other than the wrapper's own or none of its
parameters is trainable, when global module hooks other than the engine's are registered, and
when the wrapper keeps autograd's weight gradients or the model is sharded (FSDP2).
"""

import weakref
from typing import Optional, Set

import torch
import torch.nn as nn

from opacus_dp.distributed.data_parallel import own_global_hook_ids
from opacus_dp.layers.batch_first import BatchFirstLinear
from opacus_dp.layers.joined_steps import JoinedSteps, register
from opacus_dp.module_parameters import has_trainable_parameters, own_parameters
from opacus_dp.torch_internals import current_graph_task_id, global_module_hook_ids


def joinable_cells(model: nn.Module):
    """``(path, cell)`` of the cells whose step projection shares ``ih``'s output gradient."""
    for path, cell in model.named_modules():
        if ("ih", "hh") in getattr(cell, "_dp_shared_gate_gradients", ()) \
                and isinstance(getattr(cell, "hh", None), BatchFirstLinear):
            yield path, cell


class JoinedStepCalls:
    """The recorder of one cell (:func:`~opacus_dp.layers.joined_steps.register`); holds the
    wrapper weakly. ``hook_ids``: the wrapper's own hooks on ``cell.hh``."""

    def __init__(self, wrapper, path: str, cell: nn.Module, hook_ids: Set[int]):
        self._wrapper, self._cell = weakref.ref(wrapper), weakref.ref(cell)
        self._path = f"{path}.hh" if path else "hh"
        self._hook_ids = hook_ids

    def install(self):
        """Register for the cell; returns the handle (``remove()``)."""
        return register(self._cell(), self)

    def __call__(self, gates: torch.Tensor, steps: int) -> Optional[JoinedSteps]:
        wrapper, cell = self._wrapper(), self._cell()
        if wrapper is None or cell is None or not self._applies(wrapper, cell.hh, gates):
            return None
        hh = cell.hh
        for _, param in own_parameters(hh):
            wrapper._outside_use.watch(param)  # as the weight-gradient switch does at a call
        bias = None if hh.bias is None else hh.bias.detach()
        return JoinedSteps(hh.weight.detach(), bias, steps, self._record)

    def _applies(self, wrapper, hh: nn.Module, gates: torch.Tensor) -> bool:
        return (torch.is_grad_enabled() and gates.requires_grad and wrapper._recording()
                and wrapper.skips_weight_grads and not wrapper._taps.learning
                and current_graph_task_id() == -1
                and type(hh) is BatchFirstLinear and "forward" not in vars(hh)
                and has_trainable_parameters(hh)
                and set(hh._forward_pre_hooks) | set(hh._forward_hooks) <= self._hook_ids
                and not hh._backward_hooks and not hh._backward_pre_hooks
                and global_module_hook_ids() <= own_global_hook_ids())

    def _record(self, inputs: torch.Tensor, gates: torch.Tensor) -> None:
        wrapper, cell = self._wrapper(), self._cell()
        if wrapper is not None and cell is not None:
            wrapper._record_joined_steps(self._path, cell.hh, inputs, gates)
