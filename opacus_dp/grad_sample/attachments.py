"""What a per-sample-gradient wrapper attaches to the user's model, and how the model refers
back to it: weakly, so that a wrapper dropped without ``close()`` is collected while the model
lives on, and a finalizer then removes everything it attached (:class:`_Attachments`).

**Copies.** ``copy.deepcopy`` of the model (or of any of its submodules) while a wrapper is
attached gives a plain model: the wrapper's hooks and the attributes it added are left out of the
copy (the user's own hooks are kept), so the copy trains with ordinary ``p.grad`` and the wrapper
keeps recording only the original (:func:`plain_deepcopy`). Parameters are copied by
``nn.Parameter.__deepcopy__``, which keeps neither hooks nor attributes such as ``grad_sample``.
"""

import copy
import weakref
from typing import Any, Dict, List, Optional, Set

import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from opacus_dp.distributed import data_parallel
from opacus_dp.grad_sample.bookkeeping.weight_grad_skipping import Switches
from opacus_dp.grad_sample.per_sample_store import PerSampleGradStore
from opacus_dp.module_parameters import forget_canonical

_HOOKED_BY: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def _owner(module: nn.Module) -> Optional[nn.Module]:
    """The live wrapper whose hooks sit on ``module`` (None if none, or if it was collected)."""
    ref = _HOOKED_BY.get(module)
    return None if ref is None else ref()


def weakly(method, default=None):
    """``method`` (bound) called through a weak reference to its object, ``default`` once that is
    gone: how the user's model (and state kept by a finalizer) refers to a wrapper."""
    ref = weakref.WeakMethod(method)

    def call(*args, **kwargs):
        live = ref()
        return default if live is None else live(*args, **kwargs)

    return call


def plain_deepcopy(module: nn.Module, memo: Dict[Any, Any], hook_ids: Set[int]) -> nn.Module:
    """``copy.deepcopy(module, memo)`` without the hooks whose handle ids are ``hook_ids`` and
    without the instance attributes a wrapper added (module doc). The reduction is the module's
    own (``__reduce_ex__``/``__getstate__``), as ``copy.deepcopy`` does; a class's own ``__deepcopy__``
    is not used, and the attributes its ``_shared_by_copies`` names are shared, not copied."""
    reduced = module.__reduce_ex__(4)
    func, args, state = reduced[0], reduced[1], reduced[2] if len(reduced) > 2 else None
    if any(part is not None for part in reduced[3:]) or (state is not None and not isinstance(state, dict)):
        raise TypeError(f"copy.deepcopy of {type(module).__name__}, whose reduction is not a plain state "
                        "dict, is not supported while it is private: close() its wrapper first")
    for name in getattr(type(module), "_shared_by_copies", ()):  # e.g. DPDDP's process group
        if isinstance(state, dict) and state.get(name) is not None:
            memo.setdefault(id(state[name]), state[name])
    copied = func(*copy.deepcopy(args, memo))
    memo[id(module)] = copied
    memo.setdefault(id(memo), []).append(module)  # as copy.deepcopy: keep ids unique while it runs
    if state is not None:
        state = copy.deepcopy(_without_added(module, state, hook_ids), memo)
        if hasattr(copied, "__setstate__"):
            copied.__setstate__(state)
        else:
            copied.__dict__.update(state)
    return copied


def _without_added(module: nn.Module, state: Dict[str, Any], hook_ids: Set[int]) -> Dict[str, Any]:
    """``state`` (a shallow copy of the module's ``__dict__``) without what a wrapper added: its
    entries in every hook table (keyed by handle id), the copy guard, a taken-over ``replicate``."""
    state = dict(state)
    state.pop("__deepcopy__", None)
    if module in data_parallel._TAKEN_OVER:
        state.pop("replicate", None)
    for name, table in list(state.items()):
        if "hooks" in name and isinstance(table, dict) and any(key in hook_ids for key in table):
            state[name] = type(table)((key, value) for key, value in table.items() if key not in hook_ids)
    return state


class _CopyGuard:
    """A module's instance ``__deepcopy__`` (found by ``copy.deepcopy`` before the class's
    reduction) while a wrapper is attached: :func:`plain_deepcopy` with the wrapper's hooks."""

    def __init__(self, module: nn.Module, attachments: "_Attachments"):
        self.module, self.attachments = weakref.ref(module), weakref.ref(attachments)

    def __call__(self, memo: Optional[Dict[Any, Any]] = None) -> nn.Module:
        memo = {} if memo is None else memo
        attachments = self.attachments()
        if attachments is None:
            return plain_deepcopy(self.module(), memo, set())
        key = ("opacus_dp hook ids", id(attachments))  # once per copy.deepcopy call, not per module
        if key not in memo:
            memo[key] = attachments.hook_ids()
        return plain_deepcopy(self.module(), memo, memo[key])


class _Attachments:
    """What a wrapper attached to the user's model, held without the wrapper (hook handles, weight
    gradient switches, ownership records, ``p.grad_sample`` views, taken-over DataParallels):
    :meth:`detach` removes it all, at ``close()`` or when the wrapper is collected."""

    def __init__(self, module: nn.Module, store: PerSampleGradStore, token: weakref.ref):
        self.module, self.store, self.token = module, store, token
        self.handles: List[Any] = []
        self.switches: Optional[Switches] = None
        for sub in module.modules():  # copies leave out everything attached here (module doc)
            if "__deepcopy__" not in sub.__dict__:  # before a class's own __deepcopy__ too
                sub.__dict__["__deepcopy__"] = _CopyGuard(sub, self)

    def hook_ids(self) -> Set[int]:
        """Ids of the module hooks attached (``RemovableHandle.id``, unique across all tables)."""
        return {handle.id for handle in self.handles if isinstance(handle, RemovableHandle)}

    def detach(self) -> None:
        while self.handles:
            self.handles.pop().remove()
        if self.switches is not None:
            self.switches.restore()
        for sub, ref in list(_HOOKED_BY.items()):
            if ref is self.token:
                del _HOOKED_BY[sub]
        data_parallel.give_back_within(self.module)
        forget_canonical(self.module)
        for sub in self.module.modules():
            guard = sub.__dict__.get("__deepcopy__")
            if isinstance(guard, _CopyGuard) and guard.attachments() is self:
                del sub.__dict__["__deepcopy__"]
        self.store.remove_views()
