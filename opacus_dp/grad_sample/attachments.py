"""What a per-sample-gradient wrapper attaches to the user's model, and how the model refers
back to it: weakly, so that a wrapper dropped without ``close()`` is collected while the model
lives on, and a finalizer then removes everything it attached (:class:`_Attachments`)."""

import weakref
from typing import Any, List, Optional

import torch.nn as nn

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


class _Attachments:
    """What a wrapper attached to the user's model, held without the wrapper (hook handles, weight
    gradient switches, ownership records, ``p.grad_sample`` views, taken-over DataParallels):
    :meth:`detach` removes it all, at ``close()`` or when the wrapper is collected."""

    def __init__(self, module: nn.Module, store: PerSampleGradStore, token: weakref.ref):
        self.module, self.store, self.token = module, store, token
        self.handles: List[Any] = []
        self.switches: Optional[Switches] = None

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
        self.store.remove_views()
