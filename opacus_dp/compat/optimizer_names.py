"""Opacus 1.x's optimizer class names (``opacus.optimizers``), as views of the one optimizer.

opacus_dp has one optimizer class, :class:`~opacus_dp.optim.DPOptimizer`, whose clipping is a
constructor argument (Opacus grew a subclass per combination). ``DPPerLayerOptimizer(...)`` is
``DPOptimizer(..., clipping="per_layer")``, and ``isinstance(opt, DPPerLayerOptimizer)`` holds
for every DPOptimizer that clips per layer (also one built by ``make_private``);
``AdaClipDPOptimizer(...)`` is ``DPOptimizer(..., clipping=AdaptiveClipper(...))`` (the same
``isinstance`` rule). ``DistributedDPOptimizer(...)`` is ``DPOptimizer(...,
reducer=AllReduceReducer())`` (noise once, on rank 0; one all-reduce of the clipped sums;
``isinstance`` holds for every DPOptimizer with that reducer, also one ``make_private`` builds
for a DDP/DPDDP model), and the distributed per-layer names are the same with
``clipping="per_layer"``. The distributed and FSDP fast-gradient-clipping optimizers need the
model connected to them: their names raise at construction, naming ``make_private(...,
grad_sample_mode="ghost")``, which builds them.
"""

from opacus_dp.distributed.reducers import AllReduceReducer, all_reduces
from opacus_dp.optim import DPOptimizer
from opacus_dp.optim.adaptive_clipping import AdaptiveClipper

__all__ = ["DPOptimizer", "DPPerLayerOptimizer", "AdaClipDPOptimizer", "DPOptimizerFastGradientClipping",
           "DistributedDPOptimizer", "SimpleDistributedPerLayerOptimizer", "DistributedPerLayerOptimizer",
           "DistributedDPOptimizerFastGradientClipping", "FSDPOptimizerFastGradientClipping",
           "get_optimizer_class"]


class _ClipsWith(type):
    """``isinstance(opt, cls)`` holds for every DPOptimizer whose parts have what ``cls.describes``
    asks of them (capabilities of the clipper and reducer protocols, never their classes)."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, DPOptimizer) and cls.describes(obj)


class DPPerLayerOptimizer(DPOptimizer, metaclass=_ClipsWith):
    """``DPOptimizer`` clipping each parameter to its own bound (``max_grad_norm`` a list)."""

    @staticmethod
    def describes(optimizer) -> bool:
        return optimizer.clipper.per_tensor

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, clipping="per_layer", **kwargs)


class AdaClipDPOptimizer(DPOptimizer, metaclass=_ClipsWith):
    """``DPOptimizer`` with adaptive clipping (:mod:`opacus_dp.optim.adaptive_clipping`), with
    Opacus 1.6's arguments: ``max_grad_norm`` is the initial bound, ``noise_multiplier`` the
    total σ the accountant records."""

    @staticmethod
    def describes(optimizer) -> bool:
        return optimizer.clipper.releases_statistic

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


class DistributedDPOptimizer(DPOptimizer, metaclass=_ClipsWith):
    """``DPOptimizer`` over the processes of the default group (Opacus 1.6's arguments): rank 0 adds
    ``N ~ 𝒩(0, σ²·sensitivity²)`` once, the clipped sums ``S_r`` of all ranks are all-reduced, and
    the update is ``(N + Σ_r S_r) / (B · W)`` (mean reduction, ``B = expected_batch_size`` per
    rank) — see :mod:`opacus_dp.distributed.reducers`. Wrap the model in DPDDP
    (``DifferentiallyPrivateDistributedDataParallel``), not DDP, when building it directly;
    ``make_private`` does both for a DDP or DPDDP model."""

    @staticmethod
    def describes(optimizer) -> bool:
        return all_reduces(optimizer.reducer)

    def __init__(self, optimizer, *, noise_multiplier: float, max_grad_norm, expected_batch_size,
                 loss_reduction: str = "mean", generator=None, secure_mode: bool = False, **kwargs):
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction=loss_reduction,
                         generator=generator, secure_mode=secure_mode, reducer=AllReduceReducer(), **kwargs)


class SimpleDistributedPerLayerOptimizer(DistributedDPOptimizer, metaclass=_ClipsWith):
    """``DistributedDPOptimizer`` clipping each parameter to its own bound (``max_grad_norm`` a
    list ``C``; noise std ``σ·‖C‖₂``)."""

    @staticmethod
    def describes(optimizer) -> bool:
        return all_reduces(optimizer.reducer) and optimizer.clipper.per_tensor

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, clipping="per_layer", **kwargs)


DistributedPerLayerOptimizer = SimpleDistributedPerLayerOptimizer
"""Opacus 1.6's hook-based variant of the same job: the same class here (no second step sequence)."""


class _BuiltByMakePrivate:
    """A name of Opacus 1.6 whose optimizer needs the model connected to it at construction."""

    how = ""

    def __init__(self, *args, **kwargs):
        raise TypeError(f"{type(self).__name__} cannot be built on its own in opacus_dp: {self.how}")


class DistributedDPOptimizerFastGradientClipping(_BuiltByMakePrivate):
    """Refused at construction: build it with ``make_private``."""

    how = ("PrivacyEngine().make_private(module=DPDDP(model) or DDP(model), ..., grad_sample_mode='ghost', "
           "criterion=...) returns the optimizer and the loss, connected to the model and the all-reduce")


class FSDPOptimizerFastGradientClipping(_BuiltByMakePrivate):
    """Refused at construction: build it with ``make_private``."""

    how = ("PrivacyEngine().make_private(module=model sharded with torch's fully_shard (FSDP2), ..., "
           "grad_sample_mode='ghost', criterion=...) reduce-scatters the clipped sums into the shards")


_BUILDERS = {"flat": DPOptimizer, "per_layer": DPPerLayerOptimizer, "adaptive": AdaClipDPOptimizer}
_DISTRIBUTED = {"flat": DistributedDPOptimizer, "per_layer": SimpleDistributedPerLayerOptimizer}
_GHOST = {False: DPOptimizerFastGradientClipping, True: DistributedDPOptimizerFastGradientClipping}


def get_optimizer_class(clipping: str, distributed: bool, grad_sample_mode: str = "hooks"):
    """The class Opacus 1.6's ``get_optimizer_class`` names: per-sample gradients in
    ``p.grad_sample`` (``hooks``/``functorch``/``ew``) with flat, per-layer or (one process)
    adaptive clipping, or flat fast gradient clipping (``ghost``); the other combinations are
    refused with the way to get them."""
    if clipping not in _BUILDERS:
        raise ValueError(f"clipping must be 'flat', 'per_layer' or 'adaptive', got {clipping!r}")
    if grad_sample_mode == "ghost" and clipping == "flat":
        return _GHOST[bool(distributed)]
    if grad_sample_mode in ("hooks", "functorch", "ew") and not distributed:
        return _BUILDERS[clipping]
    if grad_sample_mode in ("hooks", "functorch", "ew") and clipping in _DISTRIBUTED:
        return _DISTRIBUTED[clipping]
    raise ValueError(
        f"get_optimizer_class(clipping={clipping!r}, distributed={distributed}, "
        f"grad_sample_mode={grad_sample_mode!r}): use PrivacyEngine.make_private, which builds the "
        "DPOptimizer for a DDP/DPDDP or FSDP2 model or a norms-only mode and connects its all-reduce "
        "and per-sample source")
