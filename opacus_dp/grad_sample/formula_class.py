"""Which class's registered per-layer functions apply to a layer (the registries' key).

A leaf module: the registries (:mod:`~opacus_dp.grad_sample.registry`,
:mod:`~opacus_dp.grad_sample.bookkeeping.norm_rules`) and the layers' own rules look layers up
through :func:`formula_class`.
"""

import torch.nn as nn

from opacus_dp.module_parameters import FSDPModule


def formula_class(layer: nn.Module) -> type:
    """The class whose registered functions apply to ``layer``: exactly ``type(layer)``, except
    for a layer passed to FSDP2's ``fully_shard`` itself, whose class FSDP2 replaced by one it
    made, ``type("FSDP" + name, (FSDPModule, cls), {"__deepcopy__": ...})`` (``FSDPLinear``):
    that class adds FSDP2's methods and no ``forward``, so ``cls``'s functions hold for it.

    Other subclasses do not inherit a registration: a subclass may override ``forward`` and
    the dedicated formula would then be silently wrong; they go to the generic fallback.
    """
    cls = type(layer)
    if FSDPModule is None or not isinstance(layer, FSDPModule):
        return cls
    bases = cls.__bases__
    made_by_fsdp = (len(bases) == 2 and bases[0] is FSDPModule and cls.__name__ == "FSDP" + bases[1].__name__
                    and set(cls.__dict__) <= _FSDP_CLASS_ATTRIBUTES)
    return bases[1] if made_by_fsdp else cls


# What the class FSDP2 makes for a sharded module's class defines itself (no forward).
_FSDP_CLASS_ATTRIBUTES = frozenset({"__deepcopy__", "__doc__", "__module__", "__qualname__"})
