"""Per-sample gradients inside ``nn.DataParallel`` replicas.

What ``nn.DataParallel.forward`` does, and what DP-SGD needs from it:

1. ``scatter`` splits the batch into chunks ``0..K-1`` along ``dim`` (batch order);
2. ``replicate`` copies the module once per chunk: every submodule is copied with
   ``Module._replicate_for_data_parallel`` — a *shallow* copy of ``__dict__``, so the
   forward hooks of a master layer also fire on its replicas (called with the replica);
   replica parameters are plain tensors, differentiable broadcast copies of the masters;
3. ``parallel_apply`` runs replica ``j`` on chunk ``j``, one thread per replica;
4. ``gather`` concatenates the outputs in chunk order; backward sums the replicas'
   gradients into the masters' ``.grad``.

DP-SGD needs, for every master parameter, the per-sample gradients of *all* samples in
batch order (clipping acts on the whole batch). The GradSampleModule's hooks resolve the
master parameters by name, store each replica's result under its chunk index, and the
per-sample store concatenates the chunks in index order at the end of the backward pass.

The chunk index is attached here: while a GradSampleModule exists, a module-call
pre-hook takes over ``replicate`` on every ``DataParallel`` *instance* that is called
(an instance attribute wrapping the class method; the model may have been wrapped before
or after the privacy engine) and records ``replica submodule -> chunk index`` in a weak
side table. When the last GradSampleModule is closed the hook and every instance
attribute are removed (an instance is also given back when a GradSampleModule inside
or around it is closed). A GradSampleModule collected while dynamo compiles other code (the
garbage collector runs wherever Python allocates) leaves the hook in place until the next module
call outside the compilation: dynamo builds guards on the global hooks it saw when tracing, and
fails on one removed meanwhile.

Refused, with a clear error: a replica that was not made by a taken-over ``replicate``
(another replication scheme), and layers using the generic ``torch.func`` fallback
(it reads ``layer.parameters()``, which replicas do not have).

The same call hook refuses, at its first call, ``torch.compile(private_model, fullgraph=True)``
(dynamo cannot trace the wrapper's bookkeeping into one graph; ``private_model.compile(fullgraph=True)``
compiles the model's own code as one graph: ``docs/compile.md``).
"""

import threading
import weakref
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DataParallel

from opacus_dp.module_parameters import has_trainable_parameters
from opacus_dp.torch_internals import dynamo_compiling, fullgraph_original

_CHUNK_OF: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_TAKEN_OVER: "weakref.WeakSet[DataParallel]" = weakref.WeakSet()
_OWNERS: "weakref.WeakKeyDictionary[object, weakref.finalize]" = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()
_CALL_HOOK = None
_REMOVAL_PENDING = False  # the last owner went while dynamo compiled (_drop_owner)


def _take_over_replicate(data_parallel: DataParallel) -> None:
    """Wrap ``data_parallel.replicate`` (on the instance) to record each replica's chunk."""
    class_replicate = type(data_parallel).replicate.__get__(data_parallel)

    def replicate_with_chunk_indices(module, device_ids):
        replicas = class_replicate(module, device_ids)
        for chunk, replica in enumerate(replicas):
            for sub in replica.modules():
                _CHUNK_OF[sub] = chunk
        return replicas

    data_parallel.__dict__["replicate"] = replicate_with_chunk_indices
    _TAKEN_OVER.add(data_parallel)


def _on_module_call(module: nn.Module, args) -> None:
    if _REMOVAL_PENDING and not dynamo_compiling():
        _drop_owner()
        return
    if isinstance(module, DataParallel) and module not in _TAKEN_OVER:
        with _LOCK:
            if module not in _TAKEN_OVER:
                _take_over_replicate(module)
    elif not torch.compiler.is_compiling() and fullgraph_original(module) in _OWNERS:
        raise ValueError(
            "torch.compile(private_model, fullgraph=True) cannot compile the private model as one graph: its "
            "per-sample bookkeeping runs outside the graph. Call private_model.compile(fullgraph=True) instead "
            "(in place: the model's own code is compiled as one graph, the bookkeeping runs eagerly around it), or "
            "pass the compiled model to make_private (module=torch.compile(model, fullgraph=True)); see "
            "docs/compile.md")


def acquire(owner: object) -> None:
    """``owner`` (a GradSampleModule) starts: make sure DataParallel calls are taken over.

    Undone by :func:`release` or, at the latest, when ``owner`` is garbage collected (only
    weakly referenced here).
    """
    global _CALL_HOOK, _REMOVAL_PENDING
    with _LOCK:
        _REMOVAL_PENDING = False
        if owner in _OWNERS:
            return
        if _CALL_HOOK is None:
            _CALL_HOOK = register_module_forward_pre_hook(_on_module_call)
        _OWNERS[owner] = weakref.finalize(owner, _drop_owner)


def own_global_hook_ids() -> set:
    """The handle id of the global call hook :func:`acquire` installs (empty when none is)."""
    hook = _CALL_HOOK
    return set() if hook is None else {hook.id}


def release(owner: nn.Module) -> None:
    """``owner`` is closed: give back the DataParallel instances around or inside it.

    After the last owner is gone the call hook is removed as well.
    """
    finalizer = _OWNERS.pop(owner, None)
    give_back_within(owner)
    if finalizer is not None:
        finalizer()


def give_back_within(root: nn.Module) -> None:
    """Give back the taken-over DataParallel instances around or inside ``root`` (also called
    for a GradSampleModule collected without ``close()``, with the module it wrapped)."""
    with _LOCK:
        mine = {id(m) for m in root.modules()}
        for data_parallel in list(_TAKEN_OVER):
            if any(id(m) in mine for m in data_parallel.modules()):
                _give_back(data_parallel)


def _give_back(data_parallel: DataParallel) -> None:
    data_parallel.__dict__.pop("replicate", None)
    _TAKEN_OVER.discard(data_parallel)


def _drop_owner() -> None:
    """After an owner went: without owners left, remove the call hook and give every instance
    back, unless dynamo is compiling (then at the next module call outside it: module doc)."""
    global _CALL_HOOK, _REMOVAL_PENDING
    with _LOCK:
        _REMOVAL_PENDING = False
        if any(f.alive for f in _OWNERS.values()) or _CALL_HOOK is None:
            return
        if dynamo_compiling():
            _REMOVAL_PENDING = True
            return
        _CALL_HOOK.remove()
        _CALL_HOOK = None
        for data_parallel in list(_TAKEN_OVER):
            _give_back(data_parallel)


def _fallback_refusal(describe_layer: str) -> ValueError:
    return ValueError(
        f"{describe_layer} has no registered grad sampler (it would use the generic "
        "torch.func fallback, or grad_sample_mode='functorch' was chosen), which is not "
        "supported inside nn.DataParallel replicas: use grad_sample_mode='hooks' with "
        "supported layers, or DistributedDataParallel instead of nn.DataParallel"
    )


def refuse_unsupported_replicas(module: nn.Module, has_registered_sampler: Callable) -> None:
    """At wrapping time: every layer with trainable parameters inside an ``nn.DataParallel`` of
    ``module`` must have a registered grad sampler (replicas own no ``parameters()``); one
    unfrozen later is refused at its call (:func:`chunk_of`)."""
    for outer_path, data_parallel in module.named_modules():
        if not isinstance(data_parallel, DataParallel):
            continue
        for path, layer in data_parallel.named_modules(prefix=outer_path):
            if has_trainable_parameters(layer) and not has_registered_sampler(layer):
                raise _fallback_refusal(f"{path} ({type(layer).__name__})")


def chunk_of(layer: nn.Module, master: nn.Module, *, describe_layer: str,
             uses_registered_sampler: bool) -> int:
    """The batch chunk handled by ``layer``: 0 for the master itself, else the replica's.

    Raises ``ValueError`` for replicas DP-SGD cannot handle (see the module docstring).
    """
    if layer is master:
        return 0
    chunk = _CHUNK_OF.get(layer)
    if chunk is None:
        raise ValueError(
            f"{describe_layer} was called through a copy of the module that was not made by "
            "nn.DataParallel.replicate; per-sample gradients of such replicas cannot be "
            "assigned to their samples. Use nn.DataParallel or DistributedDataParallel."
        )
    if not uses_registered_sampler:
        raise _fallback_refusal(describe_layer)
    return chunk


def chunk_index(layer: nn.Module) -> Optional[int]:
    """Chunk recorded for a replica submodule (None for masters and unknown modules)."""
    return _CHUNK_OF.get(layer)
