"""The one table of ``grad_sample_mode``s: which wrapper each builds, with which options, and
what ``"auto"`` picks. ``make_private``, ``attach`` (:mod:`opacus_dp.engine_setup`) and Opacus's
``wrap_model`` / ``get_gsm_class`` (:mod:`opacus_dp.grad_sample.utils`) all read it.

* ``"hooks"`` (and Opacus's ``"ew"``, ExpandedWeights: the same per-sample gradients):
  :class:`GradSampleModule` with the dedicated per-layer samplers;
* ``"functorch"``: the same wrapper with the ``torch.func`` fallback for every layer;
* ``"bk"``: :class:`BookkeepingGradSampleModule` with the ``"mixed"`` layer rule — per layer
  the cheaper of the ghost norm and materialised per-sample gradients (Bu et al. 2022), the
  clipped sum assembled from the recorded inputs and output gradients in the same backward
  pass (Bu et al. 2023), autograd's weight gradients skipped;
* ``"ghost"``: the same wrapper and per-layer rule, and, as in Opacus 1.6, ``make_private``
  also returns a criterion whose losses' ``backward()`` runs two passes (norms, then clipped
  sums; :mod:`~opacus_dp.grad_sample.bookkeeping.ghost_criterion`);
* ``"auto"``: a rule from the model's structure, no measurement: ``"hooks"`` if the model
  contains ``nn.DataParallel`` (the norms-only modes do not support it), else ``"bk"``, which
  does the least arithmetic (per layer the cheaper computation, no autograd weight gradient, no
  second backward; see ``docs/benchmarks.md``).

``options`` make the mode; ``engine_options`` are what the privacy engines add for speed (the
DP optimizer forms ``p.grad`` from the per-sample gradients, so autograd's own weight gradient
is skipped). Opacus's ``wrap_model`` builds ``options`` only, and keeps ``p.grad`` as Opacus does.
"""

from dataclasses import dataclass, field
from typing import Mapping, Type

import torch.nn as nn
from torch.nn.parallel import DataParallel

from opacus_dp.grad_sample.bookkeeping.module import BookkeepingGradSampleModule
from opacus_dp.grad_sample.grad_sample_module import GradSampleModule
from opacus_dp.grad_sample.grad_sample_module_fast_gradient_clipping import GradSampleModuleFastGradientClipping


@dataclass(frozen=True)
class Mode:
    """One row of the table: the engines' wrapper class, its options, the engines' extra
    options, and the class Opacus's API returns for the mode (default: the same)."""

    wrapper: Type[GradSampleModule]
    options: Mapping = field(default_factory=dict)
    engine_options: Mapping = field(default_factory=dict)
    opacus_wrapper: Type[GradSampleModule] = None

    def opacus_class(self) -> Type[GradSampleModule]:
        return self.opacus_wrapper or self.wrapper


_HOOKS = Mode(GradSampleModule, engine_options={"skip_weight_grads": True})
MODES: Mapping[str, Mode] = {
    "hooks": _HOOKS,
    "ew": _HOOKS,
    "functorch": Mode(GradSampleModule, {"force_functorch": True}, {"skip_weight_grads": True}),
    "ghost": Mode(BookkeepingGradSampleModule, {"layer_rule": "mixed"},
                  opacus_wrapper=GradSampleModuleFastGradientClipping),
    "bk": Mode(BookkeepingGradSampleModule, {"layer_rule": "mixed"}),
}
MODE_NAMES = (*MODES, "auto")  # what grad_sample_mode accepts


def choose_mode(module: nn.Module) -> str:
    """The mode ``"auto"`` stands for, for ``module`` (see the module doc)."""
    if any(isinstance(m, DataParallel) for m in module.modules()):
        return "hooks"
    return "bk"


def mode_of(name: str, module: nn.Module) -> Mode:
    """The table's row for ``name`` (``"auto"`` resolved for ``module``)."""
    if name not in MODE_NAMES:
        raise ValueError(f"grad_sample_mode must be one of {', '.join(map(repr, MODE_NAMES))}, got {name!r}")
    return MODES[choose_mode(module) if name == "auto" else name]


def wrap_for_engine(module: nn.Module, name: str, *, batch_first: bool, loss_reduction: str) -> GradSampleModule:
    """The wrapper ``make_private`` / ``attach`` build for mode ``name`` (strict validation)."""
    mode = mode_of(name, module)
    return mode.wrapper(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=True,
                        **mode.options, **mode.engine_options)


def wrap_norms_only(module: nn.Module, name: str, *, batch_first: bool, loss_reduction: str) -> GradSampleModule:
    """:func:`wrap_for_engine` for ``name`` in ``("bk", "ghost", "auto")``."""
    if name not in ("bk", "ghost", "auto"):
        raise ValueError(f"mode must be 'bk', 'ghost' or 'auto', got {name!r}")
    return wrap_for_engine(module, name, batch_first=batch_first, loss_reduction=loss_reduction)
