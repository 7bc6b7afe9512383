"""Compatibility import path (Opacus 1.x ``opacus.optimizers``).

opacus_dp has one optimizer class, :class:`~opacus_dp.optim.DPOptimizer`, whose clipping is a
constructor argument (Opacus grew a subclass per combination). ``DPPerLayerOptimizer(...)`` is
``DPOptimizer(..., clipping="per_layer")``, and ``isinstance(opt, DPPerLayerOptimizer)`` holds
for every DPOptimizer that clips per layer (also one built by ``make_private``);
``AdaClipDPOptimizer(...)`` is ``DPOptimizer(..., clipping=AdaptiveClipper(...))`` (the same
``isinstance`` rule). Distributed and
fast-gradient-clipping optimizers are set up by ``PrivacyEngine.make_private`` (a DDP/DPDDP
model, ``grad_sample_mode="ghost"``), which also connects the per-sample source and the
all-reduce they need.
"""

from opacus_dp.optim import DPOptimizer
from opacus_dp.optim.adaptive_clipping import AdaptiveClipper
from opacus_dp.optim.clipping import PerLayerClipper

__all__ = ["DPOptimizer", "DPPerLayerOptimizer", "AdaClipDPOptimizer", "DPOptimizerFastGradientClipping",
           "get_optimizer_class"]


class _ClipsWith(type):
    """``isinstance(opt, cls)`` holds for every DPOptimizer whose clipper is a ``cls.clipper_type``."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, DPOptimizer) and isinstance(getattr(obj, "clipper", None), cls.clipper_type)


class DPPerLayerOptimizer(DPOptimizer, metaclass=_ClipsWith):
    """``DPOptimizer`` clipping each parameter to its own bound (``max_grad_norm`` a list)."""

    clipper_type = PerLayerClipper

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, clipping="per_layer", **kwargs)


class AdaClipDPOptimizer(DPOptimizer, metaclass=_ClipsWith):
    """``DPOptimizer`` with adaptive clipping (:mod:`opacus_dp.optim.adaptive_clipping`), with
    Opacus 1.6's arguments: ``max_grad_norm`` is the initial bound, ``noise_multiplier`` the
    total σ the accountant records."""

    clipper_type = AdaptiveClipper

    def __init__(self, optimizer, *, noise_multiplier: float, target_unclipped_quantile: float,
                 clipbound_learning_rate: float, max_clipbound: float, min_clipbound: float,
                 unclipped_num_std: float, max_grad_norm: float, **kwargs):
        clipper = AdaptiveClipper(max_grad_norm, target_unclipped_quantile=target_unclipped_quantile,
                                  clipbound_learning_rate=clipbound_learning_rate,
                                  max_clipbound=max_clipbound, min_clipbound=min_clipbound,
                                  unclipped_num_std=unclipped_num_std)
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         clipping=clipper, **kwargs)


class _AwaitingLoss:
    """The per-sample source (a :class:`~opacus_dp.per_sample_source.GradSource`) of a
    DPOptimizerFastGradientClipping before a DPLossFastGradientClipping connects it to the model."""

    forms_sums_in_backward = False

    def clear(self, params) -> None:
        """Nothing is held before the loss wrapper connects the model (``zero_grad`` calls this)."""

    def set_factor_function(self, factor_function) -> None:
        """Nothing is formed before the model is connected."""

    def pending_passes(self) -> int:
        return 0

    def per_sample_norms(self, params, name_of=None):
        raise ValueError(
            "DPOptimizerFastGradientClipping takes the per-sample norms from the model: build the "
            "loss with DPLossFastGradientClipping(model, optimizer, criterion) and call backward() on "
            "its losses (or use make_private(..., grad_sample_mode='ghost')); no update was made")

    def clipped_sums(self, params, factors):
        return self.per_sample_norms(params)


class DPOptimizerFastGradientClipping(DPOptimizer):
    """Opacus 1.6's optimizer for fast gradient clipping (flat clipping, one process): a
    ``DPOptimizer`` connected to the model by ``DPLossFastGradientClipping`` (see
    :mod:`opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping`)."""

    def __init__(self, optimizer, *, noise_multiplier: float, max_grad_norm: float, expected_batch_size,
                 loss_reduction: str = "mean", generator=None, secure_mode: bool = False, **kwargs):
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
                         generator=generator, secure_mode=secure_mode, clipping="flat",
                         grad_source=_AwaitingLoss(), **kwargs)


_BUILDERS = {"flat": DPOptimizer, "per_layer": DPPerLayerOptimizer, "adaptive": AdaClipDPOptimizer}


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str = "hooks"):
    """The constructor Opacus's ``get_optimizer_class`` names for a single-process run with
    per-sample gradients in ``p.grad_sample`` (``hooks``/``functorch``/``ew``), or with flat
    fast gradient clipping (``ghost``); the other combinations are refused with the way to
    get them."""
    if clipping not in _BUILDERS:
        raise ValueError(f"clipping must be 'flat', 'per_layer' or 'adaptive', got {clipping!r}")
    if (clipping, distributed, grad_sample_mode) == ("flat", False, "ghost"):
        return DPOptimizerFastGradientClipping
    if distributed or grad_sample_mode not in ("hooks", "functorch", "ew"):
        raise ValueError(
            f"get_optimizer_class(distributed={distributed}, grad_sample_mode={grad_sample_mode!r}): "
            "use PrivacyEngine.make_private, which builds the DPOptimizer for a DDP/DPDDP model "
            "or a norms-only mode and connects its all-reduce and per-sample source"
        )
    return _BUILDERS[clipping]

from opacus_dp.submodules import submodule_getattr  # noqa: E402

__getattr__ = submodule_getattr(__name__)  # sub-modules as attributes, as in Opacus
