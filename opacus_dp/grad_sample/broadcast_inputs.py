"""Layer calls on one sample broadcast over the batch (position ids): expanded to the batch.

GPT-2 and BERT embed positions as ``P = wpe(position_ids)`` with ``position_ids`` of shape
``(1, T)`` and add ``P`` ``(1, T, d)`` to the token embeddings ``E`` ``(B, T, d)``. The gradient
reaching ``P`` is ``Σ_i ∂L_i/∂P``: the samples' shares are summed before the layer's hook sees
them, and no per-sample gradient can be formed from it. Such a call is therefore made on its
inputs expanded to the batch, ``wpe(position_ids.expand(B, T))`` (a view with stride 0, no
copy): ``E + P'`` has the same values, row ``i`` of ``P'`` is used by sample ``i`` alone, so the
gradient reaching it is ``∂L_i/∂P'_i``, and the layer's per-sample gradient of sample ``i`` is
the gradient through that sample's copy: exact.

Which calls: a call of a hooked layer that records (grad enabled, hooks on, a trainable
parameter) whose tensor arguments all have size 1 on the batch dimension while the pass's batch
size ``B`` is larger (such a call failed the one-batch-size-per-pass check before); models
without such calls are not affected. ``nn.EmbeddingBag`` is left alone (its rows are bags cut
by ``offsets``).

``B`` is the batch size of the latest call in the wrapped model's running forward (marked by hooks
on the model) that was not expanded: a layer called on the batch before (GPT-2's and BERT's token
embeddings come before their position embeddings). Before any such call, the model's inputs
decide, but only for a call shaped like the model's first tensor argument with 1 in place of its
``B`` samples, perhaps without its last dimensions (``(1, T)`` position ids next to ``(B, T)``
token ids or ``(B, T, d)`` embeddings), and only if every other tensor
argument has ``B`` rows or 1, and never in a model with DP layers (``_dp_batch_dim``: they
rearrange their inputs, whose layout need not be the wrapper's ``batch_first``): a guess from the
inputs alone could take a sequence dimension for the batch. So ``model(ids, side)`` with ``ids``
of one sample and ``side`` of ``K`` rows expands nothing. During a backward pass (a
checkpointed block recomputed) the ``B`` of the model's last forward in the thread is used; a
recomputation that differs from the original forward is refused by torch. Outside the model's
forward (its parts called directly, the threads of ``nn.DataParallel`` replicas on several
devices) nothing is expanded. A call not expanded is refused by the batch size check, with the
way out in its message.

Limits: the output must be used by broadcasting against the batch (``E + P``, the usual use);
code that takes it as one tensor (``P[0]``, ``P.sum()``) would see ``B`` copies. An input without
a batch dimension (positions of shape ``(T,)``) is not a batch of one: it is refused when
``T ≠ B``, and cannot be told from ``T`` per-sample ids when ``T = B`` (give it one:
``positions[None]``).
"""

import threading
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from opacus_dp.grad_sample.compiled_modules import EagerAroundCompiledCall
from opacus_dp.grad_sample.layer_call import FEATURE_LAST_LAYERS, layer_batch_dim
from opacus_dp.module_parameters import has_trainable_parameters
from opacus_dp.torch_internals import current_graph_task_id

BROADCAST_HINT = (  # for the messages of the one-batch-size-per-pass check
    " A layer called on one sample (position ids of shape (1, T)) is expanded to the batch when "
    "the batch size is known at its call: call the wrapped model itself (its inputs give the "
    "batch size), not its parts. An input without a batch dimension (positions of shape (T,)) "
    "needs one of size 1: positions[None]."
)


class _State(threading.local):
    """One thread's view of the model's forward passes (a replica thread has its own)."""

    def __init__(self):
        self.in_model = False
        self.latest = None  # the batch size of the latest call not expanded
        self.inputs = None  # (shape of the model's first tensor argument, B) if they agree
        self.last_size = None  # the B of the model's last forward (for recomputations)


def _tensors(args, kwargs) -> List[torch.Tensor]:
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return list(args)
    return [t for t in tree_leaves((list(args), kwargs)) if isinstance(t, torch.Tensor)]


def inputs_shape(args, kwargs, batch_dim: int) -> Optional[Tuple[torch.Size, int]]:
    """``(shape, B)`` of the first tensor argument that has ``batch_dim`` (``B`` its size there),
    if every other one has ``B`` or 1 there; else None."""
    tensors = [t for t in _tensors(args, kwargs) if t.dim() > batch_dim]
    if not tensors or any(t.shape[batch_dim] not in (1, tensors[0].shape[batch_dim]) for t in tensors):
        return None
    return tensors[0].shape, tensors[0].shape[batch_dim]


def _one_row_of(shape: torch.Size, model_shape: torch.Size, batch_dim: int) -> bool:
    """``shape`` is ``model_shape`` with 1 on ``batch_dim``, cut after a dimension past it:
    ``(1, T)`` for ``(B, T)`` token ids or ``(B, T, d)`` embeddings."""
    return batch_dim + 1 < len(shape) <= len(model_shape) and all(
        n == (1 if d == batch_dim else m) for d, (n, m) in enumerate(zip(shape, model_shape)))


def input_batch_dim(layer: nn.Module, batch_first: bool, first: torch.Tensor) -> int:
    """The batch dimension of a call's inputs: that of its output (``call_batch_dim``), one less
    rank for an ``nn.Embedding`` (ids to vectors)."""
    out_rank = first.dim() + (1 if isinstance(layer, nn.Embedding) else 0)
    if not batch_first and out_rank == 2 and isinstance(layer, FEATURE_LAST_LAYERS):
        return 0
    return layer_batch_dim(layer, batch_first)


def expanded(args, kwargs, batch_dim: int, size: int):
    """``(args, kwargs)`` with every tensor of size 1 on ``batch_dim`` expanded to ``size`` (views)."""
    def grow(value):
        if isinstance(value, torch.Tensor) and value.dim() > batch_dim and value.shape[batch_dim] == 1:
            shape = list(value.shape)
            shape[batch_dim] = size
            return value.expand(shape)
        return value

    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        return tuple(grow(a) for a in args), kwargs
    return tuple(tree_map(grow, list(args))), dict(tree_map(grow, dict(kwargs)))


class BroadcastInputs(EagerAroundCompiledCall):
    """The hooks of one wrapper that expand broadcast calls (see the module doc)."""

    def __init__(self, batch_first: bool, recording: Callable[[], bool]):
        self.batch_first = batch_first
        self._batch_dim = 0 if batch_first else 1  # of the model's inputs
        self._trust_inputs = False  # whether the model's inputs may give B (attach_to_model)
        self._recording = recording  # held weakly by the caller: no reference to the wrapper
        self._state = _State()

    def attach_to_model(self, model: nn.Module, traced: dict) -> list:
        """Hooks on the wrapped model (their handles; ``traced[handle.id]``: what dynamo traces of
        each): its inputs may give ``B``."""
        self._trust_inputs = not any(hasattr(type(m), "_dp_batch_dim") for m in model.modules())
        handles = [model.register_forward_pre_hook(self.unless_around(self._model_starts), with_kwargs=True,
                                                   prepend=True),
                   model.register_forward_hook(self.unless_around(self._model_left), with_kwargs=True, always_call=True)]
        traced.update({handle.id: self.unless_around for handle in handles})
        return handles

    def around(self, model: nn.Module, call: Callable, args, kwargs):
        """``call(*args, **kwargs)``, the wrapped ``model``'s compiled call, with the model's hooks
        run eagerly before and after it."""
        self._model_starts(model, args, kwargs)
        try:
            with self.compiled_call():
                return call(*args, **kwargs)
        finally:
            self._model_left(model, args, kwargs, None)

    def attach_to_layer(self, master: nn.Module):
        """The forward pre-hook (its handle) of hooked layer ``master`` (also a replica's)."""
        def pre_hook(layer, args, kwargs):
            return self._layer_starts(master, layer, args, kwargs)

        return master.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def _model_starts(self, model, args, kwargs) -> None:
        state = self._state
        state.inputs = inputs_shape(args, kwargs, self._batch_dim) if self._trust_inputs else None
        state.latest, state.in_model = None, True

    def _model_left(self, model, args, kwargs, output) -> None:
        """Also after an exception in the forward (``always_call``)."""
        state = self._state
        state.in_model = False
        state.last_size = state.latest if state.latest is not None else (state.inputs or (None, None))[1]

    def _target(self, first: torch.Tensor, batch_dim: int) -> Optional[int]:
        """``B`` for a call of one sample whose first tensor argument is ``first``, or None."""
        state = self._state
        if state.in_model:
            if state.latest is not None:
                return state.latest
            if state.inputs is not None and batch_dim == self._batch_dim \
                    and _one_row_of(first.shape, state.inputs[0], batch_dim):
                return state.inputs[1]
            return None
        if current_graph_task_id() != -1:  # a recomputation (checkpointing) of the last forward
            return state.last_size
        return None

    def _sizes(self, layer: nn.Module, args, kwargs) -> Optional[Tuple[List[torch.Tensor], int, List[int]]]:
        """``(tensor arguments, their batch dimension, their sizes there)`` of a call that may be
        expanded; None for a call of an ``nn.EmbeddingBag`` or without tensor arguments."""
        if isinstance(layer, nn.EmbeddingBag):
            return None
        tensors = _tensors(args, kwargs)
        if not tensors:
            return None
        batch_dim = input_batch_dim(layer, self.batch_first, tensors[0])
        return tensors, batch_dim, [t.shape[batch_dim] for t in tensors if t.dim() > batch_dim]

    def expand_for_tap(self, layer: nn.Module, args, kwargs, target):
        """A call of a tapped (compiled) forward whose tensor arguments all have one row on the
        batch dimension, expanded to its tap's ``target`` rows (new ``(args, kwargs)``); None for
        any other call. The eager rule of :meth:`_layer_starts`, the batch size given by the tap."""
        found = self._sizes(layer, args, kwargs)
        if found is None or not found[2] or any(size != 1 for size in found[2]) or target == 1:
            return None
        return expanded(args, kwargs, found[1], target)

    def _layer_starts(self, master, layer, args, kwargs):
        """Expand a broadcast call (returns new ``(args, kwargs)``), note the size of another.
        The common call (a batch) costs the size check only; the recording checks come after."""
        found = self._sizes(layer, args, kwargs) if torch.is_grad_enabled() else None
        if found is None:
            return None
        tensors, batch_dim, sizes = found
        if any(size != 1 for size in sizes):
            self._state.latest = next(size for size in sizes if size != 1)
            return None
        if not (self._recording() and has_trainable_parameters(master)):
            return None
        target = self._target(tensors[0], batch_dim) if sizes else None
        if target is None or target == 1:
            return None
        return expanded(args, kwargs, batch_dim, target)  # B = 0 too: an empty batch adds no rows
