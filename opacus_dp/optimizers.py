"""Compatibility import path (Opacus 1.x ``opacus.optimizers``).

opacus_dp has one optimizer class, :class:`~opacus_dp.optim.DPOptimizer`, whose clipping is a
constructor argument (Opacus grew a subclass per combination). ``DPPerLayerOptimizer(...)`` is
``DPOptimizer(..., clipping="per_layer")``, and ``isinstance(opt, DPPerLayerOptimizer)`` holds
for every DPOptimizer that clips per layer (also one built by ``make_private``). Distributed and
fast-gradient-clipping optimizers are set up by ``PrivacyEngine.make_private`` (a DDP/DPDDP
model, ``grad_sample_mode="ghost"``), which also connects the per-sample source and the
all-reduce they need.
"""

from opacus_dp.optim import DPOptimizer
from opacus_dp.optim.clipping import PerLayerClipper

__all__ = ["DPOptimizer", "DPPerLayerOptimizer", "get_optimizer_class"]


class _ClipsPerLayer(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, DPOptimizer) and isinstance(getattr(obj, "clipper", None), PerLayerClipper)


class DPPerLayerOptimizer(DPOptimizer, metaclass=_ClipsPerLayer):
    """``DPOptimizer`` clipping each parameter to its own bound (``max_grad_norm`` a list)."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, clipping="per_layer", **kwargs)


_BUILDERS = {"flat": DPOptimizer, "per_layer": DPPerLayerOptimizer}


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str = "hooks"):
    """The constructor Opacus's ``get_optimizer_class`` names for a single-process run with
    per-sample gradients in ``p.grad_sample`` (``hooks``/``functorch``); the other
    combinations are refused with the way to get them."""
    if clipping not in _BUILDERS:
        raise ValueError(f"clipping must be 'flat' or 'per_layer', got {clipping!r}")
    if distributed or grad_sample_mode not in ("hooks", "functorch"):
        raise ValueError(
            f"get_optimizer_class(distributed={distributed}, grad_sample_mode={grad_sample_mode!r}): "
            "use PrivacyEngine.make_private, which builds the DPOptimizer for a DDP/DPDDP model "
            "or a norms-only mode and connects its all-reduce and per-sample source"
        )
    return _BUILDERS[clipping]
